"""The suite's rank launcher (tests/helpers/zygote.py): forked ranks get what torchrun gives a rank, each its own
process, output and exit status, and a failing rank fails the launch with its output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import zygote
from helpers.dist import rank_env, run_ranks

SCRIPT = """
import atexit, json, os, sys
import torch.distributed as dist
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "EXTRA")
dist.init_process_group("gloo")
seen = {"env": {n: os.environ.get(n) for n in names}, "argv": sys.argv[1:], "cwd": os.getcwd(), "pid": os.getpid(),
        "elastic": dist.is_torchelastic_launched(), "world": dist.get_world_size(), "name": __name__}
dist.destroy_process_group()
out = sys.argv[1]
atexit.register(lambda: open(f"{out}/atexit.{seen['env']['RANK']}", "w").close())
open(f"{out}/seen.{seen['env']['RANK']}.json", "w").write(json.dumps(seen))
print("hello from", seen["env"]["RANK"])
sys.exit(int(sys.argv[2]) if seen["env"]["RANK"] == "1" else 0)
"""


def test_each_rank_gets_torchruns_variables_its_argv_and_its_own_process(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = run_ranks([str(script), str(tmp_path), "0"], timeout=120, env=rank_env(EXTRA="x"))
    seen = [json.loads((tmp_path / f"seen.{rank}.json").read_text()) for rank in (0, 1)]
    assert [s["env"]["RANK"] for s in seen] == ["0", "1"] and {s["world"] for s in seen} == {2}
    assert all(s["elastic"] and s["name"] == "__main__" and s["argv"] == [str(tmp_path), "0"] for s in seen)
    assert seen[0]["env"]["TORCHELASTIC_RUN_ID"] == seen[1]["env"]["TORCHELASTIC_RUN_ID"]
    assert seen[0]["pid"] != seen[1]["pid"] and {s["env"]["EXTRA"] for s in seen} == {"x"}
    assert all((tmp_path / f"atexit.{rank}").exists() for rank in (0, 1))  # as an interpreter's exit
    assert "[rank0] hello from 0" in proc.stdout and "[rank1] hello from 1" in proc.stdout


def test_a_failing_rank_fails_the_launch_with_its_status_and_output(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    with pytest.raises(AssertionError, match=r"exited with \[(0|-9), 3\]") as failed:
        run_ranks([str(script), str(tmp_path), "3"], timeout=120)
    assert "[rank1] hello from 1" in str(failed.value)
    codes = zygote.run_ranks(["-c"], rank_env(), tmp_path, 1, tmp_path / "logs", timeout=60)
    assert codes == [1] and "Traceback" in (tmp_path / "logs" / "rank0.err").read_text()
