"""The documentation's generated sections: every table of figures in README.md and docs/*.md is the output of
a command over the files under docs/results/, written between markers that name the command."""
