"""`python tests/parity_train.py --config C --out D`: marlflow.train with the test-only `parity` task.

The parity task (reward = output length is odd) gives every GRPO group reward variance even on a barely
trained model, so subprocess tests of resume and kills exercise real, non-zero updates.
"""

import sys

from marlflow.tasks import register
from marlflow.tasks.toy import ToyMath


@register("parity")
class Parity(ToyMath):
    name = "parity"

    def score(self, problems, outputs):
        return [float(len(o) % 2) for o in outputs]


if __name__ == "__main__":
    from marlflow.train import main

    sys.exit(main())
