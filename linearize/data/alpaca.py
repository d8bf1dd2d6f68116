"""The Stanford Alpaca prompt template, exactly as published in tatsu-lab/stanford_alpaca (train.py, PROMPT_DICT).

A record has `instruction`, `output` and an optional `input`. Records whose `input` is missing or empty use the
no-input template, like the original. The training text is prompt + output + EOS: `format_example` returns
prompt + output and the packer appends the tokenizer's EOS token id after every document, so the EOS is always the
real special token rather than its string spelling.
"""

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)


def format_prompt(record: dict) -> str:
    """The prompt for one Alpaca record, ending in '### Response:' (no trailing space or newline)."""
    # format_map substitutes into the template only, so braces inside the record's text are left alone.
    if record.get("input"):
        return PROMPT_WITH_INPUT.format_map(record)
    return PROMPT_NO_INPUT.format_map(record)


def format_example(record: dict) -> str:
    """Prompt + output: the training text of one record, before the packer's EOS."""
    return format_prompt(record) + record["output"]
