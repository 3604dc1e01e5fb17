"""Plan a timm ViT offline (meta device: no weights, no GPU, no process group): ``autosplit plan``.

    python examples/plan_vit.py vit_base_patch16_224 --mesh 4,1,1 --batch 8 --out plan_vit_b

is the command line ``autosplit plan vit_base_patch16_224 --mesh 4,1,1 --batch 8 --out plan_vit_b``
(``python -m autosplit plan ...`` without the console script); every flag of ``autosplit plan --help``
works here, and without ``--out`` the dump goes to ``plan_out``.
"""
import sys

from autosplit.__main__ import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--out" not in argv and not {"-h", "--help"} & set(argv):
        argv += ["--out", "plan_out"]
    sys.exit(main(["plan", *argv]))
