"""py-spy (--gil: only samples holding the GIL, i.e. Python work) of router and decode replica at 32 chat streams."""

import asyncio
import subprocess
import sys

sys.path.insert(0, "/work/main/bench")
sys.path.insert(0, "/work/main")
sys.path.insert(0, "/tmp/exp")
from pathlib import Path

import systems
import yaml
from threads import find, load

tag = sys.argv[1] if len(sys.argv) > 1 else "x"
app_args = yaml.safe_load(Path("/work/main/configs/config.yaml").read_text())["applications"][0]["args"]
with systems.app(app_args) as s:
    asyncio.run(load(s.base, s.model, 8, 8))
    procs = {r: find(s.roles[r]) for r in ("router", "decode_replica", "prefill_replica")}
    spies = [
        subprocess.Popen(
            [
                "/work/main/.venv/bin/py-spy",
                "record",
                "--gil",
                "--nonblocking",
                "-r",
                "100",
                "--duration",
                "20",
                "--format",
                "raw",
                "-o",
                f"/tmp/exp/{tag}-{r}.raw",
                "--pid",
                str(p.pid),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r, p in procs.items()
    ]
    tokens = asyncio.run(load(s.base, s.model, 24, 32))
    for sp in spies:
        sp.wait()
    print("tokens", tokens)
