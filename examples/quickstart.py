"""Fine-tune the embedded default with FastTrainer and watch held-out exact match rise.

    python examples/quickstart.py                 # embedded model + task, no download
    python examples/quickstart.py --model Qwen/Qwen2.5-0.5B --dataset my.jsonl   # with internet
"""

import sys

from fasttune.run.quickstart import main

if __name__ == "__main__":
    sys.exit(main())
