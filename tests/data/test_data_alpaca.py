from linearize.data.alpaca import PROMPT_NO_INPUT, PROMPT_WITH_INPUT, format_example, format_prompt


def test_templates_are_the_published_stanford_alpaca_strings():
    assert PROMPT_WITH_INPUT == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
    )
    assert PROMPT_NO_INPUT == (
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Response:"
    )


def test_record_with_input():
    record = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
    assert format_example(record) == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:5"
    )


def test_record_without_input_or_with_empty_input():
    expected_prompt = (
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nName a colour.\n\n### Response:"
    )
    assert format_prompt({"instruction": "Name a colour.", "output": "Red"}) == expected_prompt
    assert format_example({"instruction": "Name a colour.", "input": "", "output": "Red"}) == expected_prompt + "Red"


def test_braces_in_the_record_are_kept_verbatim():
    record = {"instruction": "Print {x}", "input": "{}", "output": "f'{x}'"}
    assert format_example(record).endswith("### Instruction:\nPrint {x}\n\n### Input:\n{}\n\n### Response:f'{x}'")
