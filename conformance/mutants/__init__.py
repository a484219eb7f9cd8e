"""Seeded bugs in our own kernels: the catalogue, and how one is installed.

A mutant is a textual patch to one real kernel source (kernels/triton/*.py, kernels/cpu/*.c|h,
kernels/torch/*.py, kernels/gluon/*.py), declared in the catalogue: every TOML file of this folder, one per
backend (triton.toml, cpu.toml, torch.toml, gluon.toml) and one per newer op family, all backends together
(moealign.toml, kvqupdate.toml, ...):

    [[mutant]]
    id = "tri-prefill-causal-off-by-one"      # unique, shell-safe
    file = "triton/attention.py"              # relative to the kernels package
    bug = "causal-off-by-one"                 # the bug class (CLASSES below)
    doc = "the causal diagonal one key too far"
    find = "diag_off = 0 if TOP_LEFT else L_k - L_q"
    replace = "diag_off = 1 if TOP_LEFT else L_k - L_q + 1"
    occurrence = 1                            # optional: which occurrence of `find` (default: it is unique)
    equivalent = "..."                        # optional: why no test can tell it apart (not run)
    gpu_only = "..."                          # optional: why only a GPU run can tell it apart

The kernels are never flagged for mutation: `install(id, root)` copies the kernels package into
`root`, applies the patch to the copy and points the `kernels` package at it before any kernel
module is imported, in a worker process of its own. A patch whose `find` text is gone from the
source (or occurs more than once without `occurrence`) fails loudly: the catalogue is checked
against the sources by a self-test, so a refactor that moves the code fails CI until the mutant
is rewritten.
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CATALOGUE_DIR = Path(__file__).parent
# Bug classes (the list, plus a few every family shares). A mutant names one of these.
CLASSES = {
    "causal-alignment": "top-left vs bottom-right alignment of the causal diagonal",
    "causal-off-by-one": "the causal diagonal one key early or late",
    "gqa-mapping": "query head h reads the wrong kv head (h % h_kv, or no grouping)",
    "window-edge": "a sliding-window bound off by one, or dropped",
    "softcap-order": "softcap after masking, or before the scale, or not at all",
    "sink": "the sink left out, counted twice, or kept in the returned LSE",
    "missing-rescale": "a running sum or accumulator not rescaled when the running max grows",
    "lse-base": "LSE left in base 2, or its max term dropped",
    "scale": "the softmax scale wrong or applied twice",
    "inf-minus-inf": "-inf - -inf evaluated (NaN) for rows or splits with nothing in them",
    "split-bounds": "split-KV ranges that drop or overlap keys",
    "read-past-end": "a key or element read at or past the sequence's length",
    "dropped-tail": "the last (partial) tile, page, split or block not processed",
    "paged-write": "a paged write to the wrong page or slot",
    "paged-read": "a paged read through the wrong block-table row, or a key's page taken from another position "
                  "(the split's start) instead of its own",
    "cache-loc": "a sequence's cache / block-table row taken as its batch index b (TensorRT-LLM's cache_loc ignored)",
    "ragged": "a ragged (flattened) batch's new tokens read from the wrong rows (seq_start ignored: the padded "
              "layout assumed) or one past a sequence's seq_len (TensorRT-LLM's seq_len / seq_start)",
    "metadata": "host metadata from the batch buffers wrong (TensorRT-LLM's prepare_fused_mha_metadata): seq_start an "
                "inclusive cumsum, sequences counted as the non-zero lengths, CUDA-graph padding rows carrying stale "
                "or non-zero values",
    "low-precision-accumulation": "a sum accumulated in the storage dtype instead of fp32",
    "truncated-constant": "a constant (ln 2, log2 e) with too few digits",
    "masked-row": "a fully masked row returns NaN or a uniform average instead of 0",
    "write-offset": "a write at position + 1, or through the wrong stride",
    "tf32": "a tf32 dot where fp32 (ieee) is claimed",
    "max-subtraction": "the max not subtracted before exp (overflow on large inputs)",
    "normalisation": "a division by the wrong sum, or none",
    "empty-split": "an empty split's (possibly NaN) partial read into the result",
    "stride": "a row or head stride ignored",
    # quantization family
    "nibble-order": "4-bit codes unpacked in the wrong order (pairs 2i, 2i+1 instead of j, j + 16)",
    "scale-unpack": "a packed sub-block scale or min unpacked wrong (Q4_K's 6-bit get_scale_min_k4)",
    "bsums": "the K-quant mins term (dmin x sum m_j x bsum_j) left out or wrong",
    "scale-rounding": "a scale rounded to fp16 where fp32 is used, or the other way round",
    "rounding-mode": "round half to even where ggml rounds half away from zero, or the reverse",
    "bias": "the bias left out or added twice",
    "scale-index": "a block's scale taken from the neighbouring block",
    "byte-offset": "a packed value read at the wrong byte offset of its word (a 2-byte-aligned block's codes or "
                   "scale taken from the word boundary instead of across it)",
    "zero-point": "an int4 zero point off by one (GPTQ v1 stores zero - 1)",
    "fp8-format": "FP8 codes of one format decoded as another's (e5m2 bytes read as e4m3)",
    "amax-floor": "the FP8 activation amax floor (1e-4) left out: an all-zero group divides by 0",
    # MLA
    "v-aliasing": "MLA values not the first d_v dims of the key rows (V loaded from elsewhere in the row)",
    "rope-part": "the rope part of a 576-dim MLA row taken from the wrong end",
    # rotary embeddings (rope family)
    "rope-style": "RoPE pairs (2i, 2i+1) and (i, i + rot/2) confused",
    "rope-position": "a token rotated by its index (or a neighbour's position) instead of its own position",
    "rope-angle": "the angle table misread (cos and sin swapped, a row off by one) or its frequencies built wrong",
    "rope-scope": "the rotation applied where it does not belong (V rotated too, pass-through dims rotated), or "
                  "left out where it does (q copied unrotated)",
    "inplace-alias": "an in-place kernel (out aliasing its input) reads an element after it stored a result over it "
                     "(a rotation pair's first output stored before the pair's input is read again)",
    "sparse-padding": "a -1 top-k index (padding) gathered instead of skipped",
    "scheduler": "a split scheduler's cost model or greedy wrong (FlashMLA's get_mla_metadata: the fixed cost per "
                 "piece or the payload floor dropped, a piece that fits exactly split, a split count or row "
                 "index off by one)",
    # gated MLP
    "gate-up-order": "the gate and up halves of a gated MLP swapped (up goes through the activation)",
    "activation": "an activation's formula wrong: a sigmoid that overflows or drops a term, GELU's tanh and erf forms swapped",
    "neighbour-read": "a value read at a neighbouring column, row or position instead of its own",
    # normalisations (norm family)
    "eps-placement": "eps added outside the square root (sqrt(ms) + eps) instead of inside",
    "gemma-offset": "Gemma's (1 + w) applied as w, or w as (1 + w)",
    "residual-add": "the fused residual add left out: h = x is normalised and returned",
    "padding-lanes": "an aligned row's padding lanes read into the statistics or left unwritten",
    "one-pass-variance": "the variance as E[x^2] - E[x]^2 in fp32 (cancels when |mean| >> spread)",
    # fused transformer blocks (blocks family)
    "fused-sections": "a section of a fused buffer (W_qkv's Q, K, V rows, b_qkv's) read at another's offset",
    "wo-layout": "a per-head W_o [h][aE][a_d] (or its gradient) read or written at the flat layout's offsets",
    "activation-quantization": "a quantized projection's activations not quantized as the production path does (L2)",
    # gradients (the backward ops)
    "grad-accumulation": "a gradient not summed over the rows it sums over: db, dW or dgamma of one row or block of rows",
    "vjp-transpose": "a backward stage applies the forward map, not its transpose (dW written transposed, RoPE's "
                     "gradient rotated by +angle)",
    "residual-grad": "the residual branch's gradient not added to dx (only the normalised path's)",
    "vjp-term": "a term of a VJP dropped (the rstd^2 factor of RMSNorm's dx, the mean term of LayerNorm's dx)",
    "activation-grad": "an activation's derivative wrong: the sigmoid's without its (1 - s) factor, the wrong GELU's",
    # attention backward
    "softcap-grad": "the softcap's derivative (1 - tanh^2) left out of dS",
    "gqa-grad": "dk / dv of a kv head not summed over its query heads (one head's, or each head's alone)",
    "backward-mask": "the backward recomputes P without the forward's mask (causal or window dropped)",
    # fused cache write + attention (attention.context_kv)
    "write-read-race": "a fused write-and-attend kernel reads a cache slot the same call writes (before its write "
                       "lands: the stale or poisoned slot) instead of the new token itself",
}
BACKEND_OF_DIR = {"triton": "triton", "cpu": "cpu", "torch": "torch", "gluon": "gluon"}
_ID = re.compile(r"^[a-z0-9][a-z0-9-]*$")


class MutantError(RuntimeError):
    """A catalogue entry that cannot be applied (its target text is gone, ...): one line."""


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    bug: str
    doc: str
    find: str
    replace: str
    occurrence: int | None = None
    equivalent: str | None = None
    gpu_only: str | None = None

    @property
    def backend(self) -> str:
        return BACKEND_OF_DIR[self.file.split("/", 1)[0]]

    @property
    def stem(self) -> str:
        """The op family whose cases go first: attention_decode.py -> attention, common.h -> all."""
        name = Path(self.file).stem
        return name.split("_", 1)[0]

    def patched(self, source: str) -> str:
        """`source` with the patch applied; MutantError if the target text is gone or ambiguous."""
        n = source.count(self.find)
        where = f"mutant {self.id!r} ({self.file})"
        if n == 0:
            raise MutantError(f"{where}: its target text is gone from the source: {self.find[:60]!r}")
        if self.occurrence is None and n > 1:
            raise MutantError(f"{where}: its target text occurs {n} times; give `occurrence`")
        k = self.occurrence or 1
        if k > n:
            raise MutantError(f"{where}: occurrence {k} asked, the target text occurs {n} times")
        start = -1
        for _ in range(k):
            start = source.index(self.find, start + 1)
        return source[:start] + self.replace + source[start + len(self.find):]


def kernels_root() -> Path:
    """The kernels package directory (the unpatched one, until `install` repoints it)."""
    from kernel_parity import kernels

    return Path(list(kernels.__path__)[0])


@lru_cache(maxsize=None)
def catalogue(folder: str | None = None) -> tuple[Mutant, ...]:
    """Every mutant of the catalogue, validated (MutantError naming the file and entry otherwise)."""
    out: list[Mutant] = []
    seen: set[str] = set()
    for src in sorted(Path(folder or CATALOGUE_DIR).glob("*.toml")):
        try:
            doc = tomllib.loads(src.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise MutantError(f"{src.name} is not valid TOML: {e}") from None
        out.extend(_entries(src, doc, seen))
    return tuple(out)


def _entries(src: Path, doc: dict, seen: set[str]) -> list[Mutant]:
    out = []
    for i, e in enumerate(doc.get("mutant", [])):
        where = f"{src.name} entry {i + 1}"
        for key in ("id", "file", "bug", "doc", "find", "replace"):
            if not isinstance(e.get(key), str) or not e[key]:
                raise MutantError(f"{where}: needs a non-empty string {key!r}")
        unknown = set(e) - {"id", "file", "bug", "doc", "find", "replace", "occurrence", "equivalent", "gpu_only"}
        if unknown:
            raise MutantError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        if not _ID.match(e["id"]) or e["id"] in seen:
            raise MutantError(f"{where}: id {e['id']!r} must be unique, lower-case letters, digits and '-'")
        if e["bug"] not in CLASSES:
            raise MutantError(f"{where}: bug class {e['bug']!r} is not one of {', '.join(CLASSES)}")
        if e["file"].split("/", 1)[0] not in BACKEND_OF_DIR:
            raise MutantError(f"{where}: file {e['file']!r} is not under triton/, cpu/, torch/ or gluon/")
        if e["find"] == e["replace"]:
            raise MutantError(f"{where}: find and replace are the same text")
        seen.add(e["id"])
        out.append(Mutant(e["id"], e["file"], e["bug"], e["doc"], e["find"], e["replace"],
                          e.get("occurrence"), e.get("equivalent"), e.get("gpu_only")))
    return out


def get(mutant_id: str) -> Mutant:
    for m in catalogue():
        if m.id == mutant_id:
            return m
    raise MutantError(f"unknown mutant {mutant_id!r} (parity mutants --list shows the catalogue)")


def materialise(mutant: Mutant, root: Path) -> Path:
    """A patched copy of the kernels package under `root` (reused if already there)."""
    dst = root / mutant.id / "kernels"
    if not (dst / mutant.file).exists():
        tmp = root / f".{mutant.id}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(kernels_root(), tmp / "kernels", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        target = tmp / "kernels" / mutant.file
        text = mutant.patched(target.read_text(encoding="utf-8"))
        if target.suffix == ".py":
            try:
                compile(text, str(target), "exec")
            except SyntaxError as e:
                raise MutantError(f"mutant {mutant.id!r}: the patched {mutant.file} does not compile: {e.msg}") from None
        target.write_text(text, encoding="utf-8")
        (root / mutant.id).mkdir(parents=True, exist_ok=True)
        try:
            (tmp / "kernels").rename(dst)
        except OSError:  # another worker made it first
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def install(mutant_id: str, root: str) -> None:
    """In a fresh process: make `import kernel_parity.kernels.<...>` load the mutant's patched copy.

    Runs before any kernel module is imported (the pytest plugin's configure); C kernels compile
    from the patched copy into a cache under `root`."""
    use_copy(str(materialise(get(mutant_id), Path(root))), str(Path(root) / "cache"))


def use_copy(kernels_dir: str, cache: str) -> None:
    """Point the `kernels` package at an already patched copy (a worker's setup: the parent
    process materialised it, so workers never re-read the catalogue)."""
    import os

    loaded = sorted(n for n in sys.modules if n.startswith("kernel_parity.kernels."))
    if loaded:
        raise MutantError(f"cannot install a mutant: kernel modules already imported ({loaded[0]}, ...)")
    os.environ["KERNEL_PARITY_CACHE"] = cache
    from kernel_parity import kernels

    kernels.__path__[:] = [kernels_dir]
