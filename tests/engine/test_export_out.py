"""An OUT that cannot be written (make export's, make eval's) is one line naming it, the
reason and the fix, with nothing left behind: never a traceback."""

import json
import os
from pathlib import Path

import pytest

from engine import atomic, export
from engine.config import ConfigError

PROC = Path("/proc")  # Linux: no file can be created in it, not even by root


def test_export_to_an_unwritable_out_is_one_line_before_any_checkpoint_is_read(tmp_path, capsys):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    cases = {
        PROC / "x.pt": "No such file or directory",
        PROC / "x.safetensors": "No such file or directory",
        blocked / "sub" / "x.pt": "Not a directory",
    }
    # The checkpoint is not read (it does not even exist): OUT is tried first.
    for out, reason in cases.items():
        assert export.main([str(tmp_path / "missing.pt"), str(out)]) == 2, out
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err == f"error: cannot write {out} ({reason}); choose another OUT\n"
    assert os.listdir(tmp_path) == ["a-file"] and not (PROC / "x.pt").exists()


def test_a_folder_still_to_be_made_is_tried_where_it_will_be_made(tmp_path, capsys):
    out = tmp_path / "new" / "dir" / "w.pt"
    assert export.main([str(tmp_path / "missing.pt"), str(out)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing.pt'} does not exist\n"
    assert os.listdir(tmp_path) == []  # the probe made nothing


def test_eval_out_that_cannot_be_written_is_one_config_error(tmp_path):
    """make eval's result file (engine.eval_only writes it with atomic.write_out): the engine's
    command line prints a ConfigError as one line `error: ...`, exit 2."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    for out, reason in ((PROC / "x.json", "No such file or directory"),
                        (blocked / "x.json", "Not a directory")):  # fmt: skip
        with pytest.raises(ConfigError) as caught:
            atomic.write_out(out, "{}\n")
        assert str(caught.value) == f"cannot write {out} ({reason}); choose another OUT"
    assert os.listdir(tmp_path) == ["a-file"]
    good = tmp_path / "result.json"
    atomic.write_out(good, json.dumps({"top1": 0.5}))
    assert json.loads(good.read_text()) == {"top1": 0.5}
    assert sorted(os.listdir(tmp_path)) == ["a-file", "result.json"]
