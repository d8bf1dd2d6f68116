"""Every generated section of README.md and docs/*.md is what its command makes from docs/results/ now."""

import shutil

import pytest

from experiments.docs import generated


@pytest.fixture(scope="module")
def bench_results():
    return generated.bench_results()


def test_every_generated_section_matches_its_command(bench_results):
    found = {page: generated.sections(page, bench=bench_results) for page in generated.pages()}
    assert sum(map(len, found.values())) >= 20, "the pages' generated sections were not found"
    assert generated.GENERATED.search((generated.ROOT / "README.md").read_text()), "README's tables are generated"
    stale = [generated.stale_message(s) for sections in found.values() for s in sections if s.stale]
    assert not stale, "\n".join(stale)


def test_a_hand_edit_of_a_generated_table_fails_the_check(tmp_path, bench_results):
    # A copy of one page and the results its tables come from, with one cell of its FSDP table changed.
    for results in ("fsdp", "train-graph-23", "train-still-kernels-2048-19"):
        shutil.copytree(generated.ROOT / "docs/results/h200" / results, tmp_path / "docs/results/h200" / results)
    page = tmp_path / "docs" / "training.md"
    shutil.copy(generated.ROOT / "docs" / "training.md", page)
    (clean,) = [s for s in generated.sections(page, tmp_path) if "fsdp" in s.command]
    assert not clean.stale
    text = page.read_text()
    body = text[clean.start:clean.end]
    edited = body.replace("| 1 ", "| 9 ", 1)
    assert edited != body
    page.write_text(text[:clean.start] + edited + text[clean.end:])

    (section,) = [s for s in generated.sections(page, tmp_path) if "fsdp" in s.command]
    assert section.stale
    message = generated.stale_message(section, tmp_path)
    assert message.startswith("docs/training.md: the generated section") and section.command in message

    generated.write(page, [section])  # what `--write` does puts the command's text back
    assert not any(s.stale for s in generated.sections(page, tmp_path))
    assert page.read_text() == text


def test_a_command_that_is_neither_linearize_nor_a_module_is_refused(tmp_path):
    with pytest.raises(generated.GenerationError, match="linearize ...` or `python -m MODULE"):
        generated.run_command("cat /etc/passwd", tmp_path)
