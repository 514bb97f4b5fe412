"""dflash-trainer: online training of DFlash speculative-decoding drafters against a frozen target LLM.

Importing the package makes Hugging Face offline mode the default (HF_HUB_OFFLINE=1), for the Python API as for
the CLI: targets come from local directories, GGUF files and installed packages, and a typo in a target name must
not turn into a download attempt. A value the user set (HF_HUB_OFFLINE=0 allows the hub) is left alone. When
huggingface_hub was imported before this package with the variable unset, its cached constant is switched too.
"""

import os
import sys

__version__ = "0.1.0"

if "HF_HUB_OFFLINE" not in os.environ:
    os.environ["HF_HUB_OFFLINE"] = "1"
    if "huggingface_hub.constants" in sys.modules:
        sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = True
