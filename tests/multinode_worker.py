"""One rank of the two-node test (tests/test_multinode.py), started by torchrun in a network namespace.

Trains (2,1,2) with dp_shard per layer (pipeline across the nodes, dp inside each) and (1,2,2) with
dp_shard per stage and sequence parallelism (tensor-parallel pairs inside a node, dp across them), each
for 3 AdamW steps against single-device training; writes this rank's results to OUT/rank{RANK}.json.
"""
import json
import os
import sys

import torch

from tests import checks_fsdp as C


def main(out: str) -> None:
    torch.set_num_threads(1)
    result = {"rank": int(os.environ["RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
              "node": os.environ["AUTOSPLIT_TEST_NODE"]}
    result["pp_dp"] = C.adamw_matches("timm_cls", (2, 1, 2), dp_shard="layer")
    result["tp_dp"] = C.adamw_matches("tp_timm", (1, 2, 2), dp_shard="stage", sequence_parallel=True)
    with open(os.path.join(out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
