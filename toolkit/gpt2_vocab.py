"""The GPT-2 vocabulary, offline: its facts, and an installer that needs only the package registry.

tiktoken's r50k_base is exactly GPT-2's BPE, but tiktoken downloads it on first use, which fails on
a machine without internet. The PyPI source package of openai-whisper ships the identical file; the
installer downloads that package (~800 KB, nothing is installed), checks the file's sha256 and puts
it where tiktoken looks for its cache.

    python tokenizer.py --install-gpt2-vocab
"""
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile

from toolkit.cli import CLIError
from toolkit.files import atomic_open

# the tokenizer facts (as stored in meta.json and checkpoints) of GPT-2's own vocabulary
GPT2_FACTS = {"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256, "encoding": "r50k_base"}
# tiktoken caches r50k_base under the sha1 of its download URL
R50K_CACHE_NAME = "0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4"
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
WHISPER_SDIST = "openai-whisper==20250625"
WHISPER_MEMBER = "whisper/assets/gpt2.tiktoken"
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


def install() -> str:
    """The path of GPT-2's vocabulary, put in tiktoken's cache from PyPI's openai-whisper sdist."""
    cache_dir = tiktoken_cache_dir()
    if not cache_dir:
        raise CLIError("TIKTOKEN_CACHE_DIR is set but empty, which disables tiktoken's cache; "
                       "unset it or name a folder")
    path = os.path.join(cache_dir, R50K_CACHE_NAME)
    if installed():
        return path
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", WHISPER_SDIST, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            last_line = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise CLIError(f"'{' '.join(cmd[1:])}' failed: {last_line}")
        sdists = [name for name in os.listdir(tmp) if name.endswith(".tar.gz")]
        if len(sdists) != 1:
            raise CLIError(f"expected one .tar.gz from pip download of {WHISPER_SDIST}, got "
                           f"{sorted(os.listdir(tmp))}")
        with tarfile.open(os.path.join(tmp, sdists[0])) as tar:
            members = [m for m in tar.getmembers() if m.name.endswith("/" + WHISPER_MEMBER)]
            if len(members) != 1:
                raise CLIError(f"{sdists[0]} has no {WHISPER_MEMBER}")
            data = tar.extractfile(members[0]).read()
    if hashlib.sha256(data).hexdigest() != R50K_SHA256:
        raise CLIError(f"{WHISPER_MEMBER} from {sdists[0]} has an unexpected sha256; refusing to "
                       "install it")
    with atomic_open(path, "wb") as f:
        f.write(data)
    return path
