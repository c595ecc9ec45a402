"""Run several trainer CLIs one after another in ONE python process (one interpreter start and one import of
torch / transformers for all): ``python tests/helpers/run_clis.py '[["rlhf.train_sft", [argv...]], ...]'``.
Each runs as ``python -m module argv`` would (``runpy`` with ``sys.argv`` set); a non-zero exit stops the chain."""
import json
import runpy
import sys
import time


def main(chain):
    for module, argv in chain:
        t = time.time()
        sys.argv = [module, *map(str, argv)]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            if e.code not in (0, None):
                raise
        print(f"[run_clis] {module} done in {time.time() - t:.1f} s", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
