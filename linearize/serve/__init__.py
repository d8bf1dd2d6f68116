"""`linearize serve`: an OpenAI-compatible HTTP server over one model (docs/serving.md).

`engine` schedules the requests on the model, `app` is the web layer over it, `schemas` the request and
response bodies, `detokenize` the text sent back, `command` the CLI verb. Importing this package loads
none of them, so the command's `--help` stays fast.
"""
