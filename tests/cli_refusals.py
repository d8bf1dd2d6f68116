"""The bad-input promise, as tests check it: exit status 2, one line on stderr naming the problem, and
nothing written or changed under the working folder."""

from linearize.cli import main


def listing(root):
    """Every path under `root` with its kind, size and modification time: what a command may not change."""
    return sorted((str(p.relative_to(root)), p.is_dir(), 0 if p.is_dir() else p.stat().st_size,
                   0 if p.is_dir() else p.stat().st_mtime_ns) for p in root.rglob("*"))


def refused(capsys, root, *argv, names):
    """Run the command; assert the promise and that its one line names `names` (a string or several);
    returns the line."""
    capsys.readouterr()
    before = listing(root)
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for name in [names] if isinstance(names, str) else names:
        assert name in lines[0], lines[0]
    assert "[Errno" not in lines[0] and "StaticDecoder" not in lines[0], lines[0]
    assert listing(root) == before
    return lines[0]
