"""Bad input to every subcommand: each exits 2 (3 for a cluster that cannot be reached) with one
line that names the input and the fix, no traceback, and leaves no file behind. docs/bad-inputs.md
is this table: regenerate it with `VITP_WRITE_BAD_INPUTS=1 pytest tests/cli/test_bad_inputs.py`.

In process (vitp.cli.main) and before any Ray cluster or model starts: what each case shows
is that the input is refused at the edge, not what a run would do with it."""
import io
import math
import os
import shlex
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitp.cli import main
from vitp.data.decode import DEFAULT_MAX_PIXELS, max_file_bytes
from vitp.model.convert_npz import NPZ_MEMBER_BYTES

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad-inputs.md"
HUGE = max_file_bytes(DEFAULT_MAX_PIXELS) + 1  # an image file one byte over the bound (sparse: no disk used)

# (command line, run in a directory holding the files below; exit code; what the line must say)
CASES = [
    ("config debug --set optim.lr=nan", 2, "optim.lr=nan: must be a finite number"),
    ("config debug --set optim.grad_clip=inf", 2, "optim.grad_clip=inf: must be a finite number"),
    ("config debug --set tracking.log_timeout_s=nan", 2, "tracking.log_timeout_s=nan: must be a finite number"),
    ("config debug --set optim.lr=abc", 2, "--set optim.lr=abc: expected a number"),
    ("config debug --set nosuch.key=1", 2, "unknown config key 'nosuch.key'"),
    ("config nosuchrecipe", 2, "unknown recipe 'nosuchrecipe'; recipes: debug"),
    ("config debug --set tracking.run_name=/root", 2, "tracking.run_name='/root' contains '/'"),
    ("config debug --set tracking.run_name=..", 2, "tracking.run_name='..' starts with '.'"),
    ("config debug --set tracking.run_name=-x", 2, "tracking.run_name='-x' starts with '-'"),
    ("config debug --set tracking.experiment=a/../../b", 2, "tracking.experiment='a/../../b' contains '/'"),
    ("config debug --set model.dropout=1.5", 2, "model.dropout=1.5: must be in [0, 1)"),
    # every key has a range (vitp/config/rules.py); NaN and infinity inside tuples too
    ("config debug --set data.std=0.5,0.5,nan", 2, "data.std[2]=nan: must be a finite number"),
    ("config debug --set data.mean=0.5,inf,0.5", 2, "data.mean[1]=inf: must be a finite number"),
    ("config debug --set data.std=0,0.5,0.5", 2, "data.std[0]=0.0: must be in (0, 1]"),
    ("config debug --set data.std=-0.5,0.5,0.5", 2, "data.std[0]=-0.5: must be in (0, 1]"),
    ("config debug --set data.storage_size=0", 2, "data.storage_size=0: must be in 8..8192"),
    ("config debug --set data.num_classes=-1", 2, "data.num_classes=-1: must be >= 0 (0 = as many as the corpus has)"),
    ("config debug --set model.representation_size=-1", 2, "model.representation_size=-1: must be in 0..65536"),
    ("config debug --set tune.num_samples=-1", 2, "tune.num_samples=-1: must be >= 1"),
    ("config debug --set tune.trial_retries=-1", 2, "tune.trial_retries=-1: must be >= 0"),
    ("config debug --set tune.max_concurrent_trials=-1", 2, "tune.max_concurrent_trials=-1: must be >= 0"),
    ("config debug --set tune.perturbation_interval=-1", 2, "tune.perturbation_interval=-1: must be >= 0"),
    ("config debug --set tune.startup_trials=-1", 2, "tune.startup_trials=-1: must be >= 0"),
    ("config debug --set data.image_size=1000000", 2, "data.image_size=1000000: must be in 8..4096"),
    ("config debug --set model.num_classes=2000000", 2, "model.num_classes=2000000: must be at most 1000000"),
    ("config debug --set train.steps=1e9", 2, "train.steps=1000000000: must be at most 10000000"),
    # floats nearer 0 than a sane minimum, or subnormal (below the smallest normal float)
    ("config debug --set optim.lr=1e-320", 2, "optim.lr=1e-320: must be at least 1e-10"),
    ("config debug --set tracking.log_timeout_s=1e-300", 2,
     "tracking.log_timeout_s=1e-300: must be at least 0.001 (a millisecond)"),
    ("config debug --set model.dropout=1e-310", 2,
     "model.dropout=1e-310: must be 0 or at least 2.2250738585072014e-308 (the smallest normal float"),
    # MLflow's own tags (who ran it, from where) and tags that hide what they say
    ("config debug --set 'tracking.tags={{\"mlflow.user\": \"admin\"}}'", 2,
     "tracking.tags: tag name 'mlflow.user' is MLflow's own"),
    ("config debug --set 'tracking.tags={{\"mlflow.source.name\": \"train.py\"}}'", 2,
     "tracking.tags: tag name 'mlflow.source.name' is MLflow's own"),
    ("config debug --set 'tracking.tags={{\"team\": \"a\u202eb\"}}'", 2,
     "tracking.tags['team']: the value contains '\\u202e' (U+202E RIGHT-TO-LEFT OVERRIDE)"),
    ("config debug --set 'tracking.tags={{\"team\u200b\": \"vision\"}}'", 2,
     "tracking.tags: tag name 'team\\u200b' contains '\\u200b' (U+200B ZERO WIDTH SPACE)"),
    # the filesystem root as the folder everything is written into
    ("config debug --set work_dir=/", 2, "work_dir='/' is the filesystem root"),
    ("pretrain debug --set work_dir=/tmp/..", 2, "work_dir='/tmp/..' is the filesystem root"),
    ("demo --work-dir /", 2, "work_dir='/' is the filesystem root"),
    # names: one component, counted in bytes, no invisible or direction-changing characters
    ("config debug --set tracking.run_prefix=../x", 2, "tracking.run_prefix='../x' contains '/'"),
    ("config debug --set tracking.run_name=" + "\u00e9" * 65, 2, "is 130 bytes long in UTF-8 (at most 128"),
    ("config debug --set tracking.run_name=run\u202ex", 2,
     "tracking.run_name='run\\u202ex' contains '\\u202e' (U+202E RIGHT-TO-LEFT OVERRIDE)"),
    ("config debug --set tracking.experiment=a\u200bb", 2,
     "tracking.experiment='a\\u200bb' contains '\\u200b' (U+200B ZERO WIDTH SPACE)"),
    ("config debug --set tracking.run_name=a\x85b", 2, "tracking.run_name='a\\x85b' contains '\\x85' (U+0085)"),
    ("sweep debug_finetune --name a\u2066b", 2, "--name='a\\u2066b' contains '\\u2066' (U+2066 LEFT-TO-RIGHT ISOLATE)"),
    ("export emptydir --register a\ufeffb", 2,
     "--register='a\\ufeffb' contains '\\ufeff' (U+FEFF ZERO WIDTH NO-BREAK SPACE)"),
    ("config debug --set optim.beta2=1", 2, "optim.beta2=1.0: must be in [0, 1)"),
    ("config debug --set optim.weight_decay=-1", 2, "optim.weight_decay=-1.0: must be in [0, inf)"),
    ("config debug --set tracking.spool_max_mb=0", 2, "tracking.spool_max_mb=0.0: must be > 0"),
    ("config debug --set data.shard_mb=-1", 2, "data.shard_mb=-1.0: must be > 0"),
    ("config debug --set parallel.num_workers=0", 2, "parallel.num_workers=0: must be positive"),
    ("config debug --set parallel.zero_stage=5", 2, "parallel.zero_stage=5: ZeRO stage must be 0, 1, 2 or 3"),
    ("config debug --set data.image_size=30", 2, "data.image_size=30 is not divisible by the patch size 8"),
    ("config debug --set data.storage_format=gif", 2, "data.storage_format='gif' is not allowed"),
    ("config debug --set data.shards=s3://AKIAFAKE:se%2Fcret@bucket/shards", 2,
     "data.shards: a storage URI with credentials in it (user:password@) is refused"),
    ("config debug --set work_dir=s3://AKIAFAKE:se/cret@bucket/vit", 2,  # a secret with "/" as is
     "work_dir: a storage URI with credentials in it (user:password@) is refused"),
    ("pretrain debug --set train.init_from=missing.safetensors", 2, "train.init_from='missing.safetensors' does not exist"),
    ("model X/99", 2, "model.variant='X/99' is not a ViT variant"),
    ("synth debug --set data.synth_classes=0", 2, "data.synth_classes=0: must be > 0"),
    # a home directory named as the output of a command that deletes what it replaces
    ("synth debug --overwrite --out home", 2, "{d}/home: holds files vitp synth did not write (.bashrc, "),
    ("synth debug --out home/Documents", 2, "{d}/home/Documents: holds files vitp synth did not write (notes.txt)"),
    ("demo --fresh --work-dir home", 2, "--work-dir home: not made by vitp demo (no .vitp-demo file in it)"),
    # a real run's work dir holds the very names a demo writes: only the demo's mark counts
    ("demo --fresh --work-dir work", 2, "--work-dir work: not made by vitp demo (no .vitp-demo file in it), so "
     "--fresh deletes nothing there"),
    ("preprocess debug --set data.source=imagefolder --set data.path=missing", 2,
     "data.path='missing' does not exist: point it at the imagefolder dataset"),
    ("export missing", 2, "missing: no such checkpoint directory"),
    ("export emptydir", 2, "cannot export an incomplete checkpoint: {d}/emptydir: no meta.json"),
    ("export exp/config.json", 2, "exp/config.json: a file, not a checkpoint directory"),
    ("export emptydir --register ../x", 2, "--register='../x' contains '/'"),
    ("export exp --weights ema", 2, "exp: --weights ema reads a training checkpoint's EMA; this is an export"),
    ("config debug --set train.augreg=medium2 --set train.mixup_alpha=0.3", 2,
     "train.augreg=medium2 sets data.randaug_layers, data.randaug_magnitude, train.mixup_alpha"),
    ("config debug --set train.fewshot_weights=ema", 2, "train.fewshot_weights=ema needs a weight EMA"),
    ("import missing.npz --out out", 2, "missing.npz: no such file"),
    ("import corrupt.npz --out out", 2, "corrupt.npz: not an .npz file (no zip header)"),
    # a zip bomb: a member whose declared size is beyond any ViT's array; an .npy header that lies
    ("import bomb.npz --out out", 2, f"bomb.npz: its member 'w.npy' declares 2400000128 bytes uncompressed, more "
     f"than the {NPZ_MEMBER_BYTES} any array of an importable ViT takes"),
    ("import liar.npz --out out", 2, "liar.npz: its member 'w.npy' has an .npy header declaring 4398046511232 bytes"),
    # images handed to predict: no more bytes than the pipeline reads, only the pipeline's formats
    ("predict exp huge.png", 2, f"huge.png: {HUGE} bytes, more than an image within the {DEFAULT_MAX_PIXELS}-pixel "
     f"limit takes ({HUGE - 1})"),
    ("predict exp picture.ico", 2, "picture.ico: not a usable image (not_an_image: not an image of the formats read "
     "here (JPEG, PNG, BMP, GIF, TIFF, WEBP, PPM)): give a JPEG or PNG"),
    ("analyze missing", 2, "missing: no such file or directory; give a checkpoint directory"),
    ("analyze exp", 2, "exp/model.safetensors: not a readable weights file"),
    ("attention exp missing.png", 2, "missing.png: no such image file"),
    ("fewshot debug_finetune --from exp/config.json", 2, "exp/config.json: not a weights file"),
    ("fewshot debug_finetune --from emptydir", 2, "emptydir: neither an export (model.safetensors) nor a training checkpoint"),
    ("fewshot debug_finetune --from corrupt.npz", 2, "corrupt.npz: not a weights file"),
    ("finetune debug_finetune --from exp/config.json", 2, "exp/config.json: not a weights file"),
    ("finetune debug_finetune --from emptydir", 2, "emptydir: neither an export (model.safetensors) nor a training checkpoint"),
    ("finetune debug_finetune --from missing", 2, "missing: no such file or directory"),
    ("sweep debug_finetune --name ../x", 2, "--name='../x' contains '/'"),
    ("sweep debug_finetune --set tune.num_samples=0", 2, "tune.num_samples=0: must be >= 1"),
    ("compare", 2, "no MLflow store at sqlite:///{d}/work/debug/mlflow.db: nothing was logged there yet"),
    ("compare --tracking-uri sqlite:///{d}/store.db --filter 'params.x =='", 2,
     "--filter 'params.x ==': Invalid clause(s) in filter string"),
    ("compare --tracking-uri sqlite:///{d}/store.db --experiment nosuch", 2, "experiment 'nosuch' not found"),
    ("submit missing.yaml", 2, "job spec missing.yaml does not exist"),
    ("submit bad.yaml", 2, "bad.yaml: not valid YAML: expected the node content, but found '<stream end>' at line 2"),
    ("submit unknown.yaml", 2, "unknown.yaml: unknown key(s) nosuch"),
    ("jobs --address http://127.0.0.1:9", 3, "cannot reach the Ray jobs API at http://127.0.0.1:9"),
    ("mlflow-server --auth", 2, "basic auth needs an admin password: export MLFLOW_AUTH_ADMIN_PASSWORD"),
    ("mlflow-server --auth --auth-cache-s -1", 2, "auth cache time -1 s is negative: give seconds >= 0"),
    ("mlflow-server --workers 0", 2, "argument --workers: 0: must be > 0"),
    # counts and sizes of the memory planners: above 0 (0 GPUs divided by zero; -2 planned for -2)
    ("plan B/16 --gpus 0", 2, "argument --gpus: 0: must be > 0"),
    ("plan B/16 --gpus -2", 2, "argument --gpus: -2: must be > 0"),
    ("plan B/16 --gpu-mem 0", 2, "argument --gpu-mem: 0: must be > 0"),
    ("model B/16 --workers 0", 2, "argument --workers: 0: must be > 0"),
    ("model B/16 --micro-batch two", 2, "argument --micro-batch: 'two': expected an integer"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The files the cases name: an empty directory, an 'export' whose weights are noise, a
    corrupt .npz, broken and foreign job specs, and an MLflow store with one experiment."""
    from vitp.tracking.store import get_client

    d = tmp_path_factory.mktemp("bad-inputs")
    (d / "emptydir").mkdir()
    (d / "exp").mkdir()
    (d / "exp" / "config.json").write_text('{"recipe": "debug"}')
    (d / "exp" / "model.safetensors").write_bytes(bytes(range(256)) * 2)
    (d / "corrupt.npz").write_bytes(b"\x00" * 300)
    (d / "bad.yaml").write_text("entrypoint: [\n")
    (d / "unknown.yaml").write_text("nosuch: 1\n")
    (d / "home" / "Documents").mkdir(parents=True)  # what a user's home holds, beside vitp's names
    (d / "home" / ".bashrc").write_text("export PATH\n")
    (d / "home" / "Documents" / "notes.txt").write_text("mine\n")
    (d / "home" / "runs").mkdir()
    for name in ("runs/b16/checkpoint_00000010", "shards/imagenet", "mlartifacts/1"):  # a real run's work dir
        (d / "work" / name).mkdir(parents=True)
    (d / "work" / "runs" / "b16" / "checkpoint_00000010" / "meta.json").write_text("{}")
    (d / "work" / "mlflow.db").write_bytes(b"SQLite format 3\x00")
    with open(d / "huge.png", "wb") as f:  # sparse: its size, no blocks
        f.truncate(HUGE)
    Image.new("RGB", (16, 16)).save(d / "picture.ico", format="ICO")  # a format Pillow reads, predict does not
    (d / "bomb.npz").write_bytes(_npz_declaring((600_000_000,)))  # 2.4 GB of float32, as its zip says too
    (d / "liar.npz").write_bytes(_npz(_header((2**40,))))  # 4 TB, in a member of 144 bytes
    get_client(f"sqlite:///{d}/store.db").create_experiment("present")  # (with the store's lock file)
    return d


def _header(shape: tuple) -> dict:
    return {"descr": "<f4", "fortran_order": False, "shape": shape}


def _npz(header: dict, data: bytes = b"\0" * 16) -> bytes:
    """An .npz whose one member, w.npy, has this .npy header and these bytes after it."""
    npy = io.BytesIO()
    np.lib.format.write_array_header_1_0(npy, header)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("w.npy", npy.getvalue() + data)
    return out.getvalue()


def _npz_declaring(shape: tuple) -> bytes:
    """A small .npz whose member w.npy declares an array of `shape` in its .npy header and its full
    size in the zip's directory (a zip bomb's claim: zipfile reads a member up to the size its
    directory declares, numpy allocates what the header says)."""
    raw = bytearray(_npz(_header(shape)))
    size = 128 + math.prod(shape) * 4  # the header, padded to 128 bytes, and the float32 data
    central = raw.index(b"PK\x01\x02")  # the central directory entry: uncompressed size at +24
    raw[central + 24:central + 28] = struct.pack("<I", size)
    raw[22:26] = struct.pack("<I", size)  # and the local header's, at +22
    return bytes(raw)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("line, code, says", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_in_one_line_and_leaves_nothing(inputs, monkeypatch, capsys, line, code, says):
    monkeypatch.chdir(inputs)
    for key in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS", "MLFLOW_AUTH_ADMIN_PASSWORD", "VITP_STORE"):
        monkeypatch.delenv(key, raising=False)
    before = _files(inputs)
    try:
        rc = main(shlex.split(line.format(d=inputs)))
    except SystemExit as e:  # argparse's refusal of the command line
        rc = e.code
    assert rc == code
    err = capsys.readouterr().err
    first, *rest = err.strip().splitlines()
    command = line.split()[0]
    assert first.startswith(f"vitp {command}: ") and "Traceback" not in err, err
    assert all(extra.startswith("  - ") for extra in rest), err  # only a config's list of problems
    assert says.format(d=inputs) in err, err
    assert _files(inputs) == before  # nothing written, nothing removed


def _cell(text: str) -> str:
    """A table cell: the fixture folder left out, str.format's doubled braces single, pipes escaped,
    and a character that would not show (a control, a direction override, a zero-width space)
    written as its Python escape."""
    text = text.replace("{d}/", "").replace("{{", "{").replace("}}", "}").replace("|", chr(92) + "|")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _table() -> str:
    rows = "\n".join(f"| `vitp {_cell(line)}` | {code} | {_cell(says)} |" for line, code, says in CASES)
    return (f"# Bad input: what `vitp` says\n\n"
            f"Generated from `tests/cli/test_bad_inputs.py`, which runs each line below ({len(CASES)} cases) "
            "in a directory holding the files it names (`emptydir/`, `exp/` with a `config.json` and noise for "
            "weights, a corrupt `corrupt.npz`, job specs `bad.yaml` and `unknown.yaml`, an MLflow store "
            "`store.db`, `home/`: a home directory's `.bashrc` and `Documents/notes.txt` beside a `runs/` "
            "folder, `work/`: a training run's work dir (`runs/`, `shards/`, `mlartifacts/`, `mlflow.db`), "
            "`huge.png`: one byte over the bound on an image file, `picture.ico`: an icon, `bomb.npz` whose zip "
            "directory and .npy header claim a 2.4 GB array and `liar.npz` whose .npy header claims a 4 TB one "
            "in 144 bytes) and checks that the command exits with the code shown, prints one line "
            "(`vitp COMMAND: ...`; an invalid config lists its problems below it) that contains the text "
            "shown, prints no traceback, and leaves the directory as it was. Exit codes: 2 bad input you "
            "can fix, 3 a cluster that cannot be reached (`vitp --help` lists them all).\n\n"
            "| Command | Exit | The line says |\n|---|---|---|\n" + rows + "\n")


def test_the_docs_table_is_these_cases():
    if os.environ.get("VITP_WRITE_BAD_INPUTS"):
        DOC.write_text(_table())
    assert DOC.read_text() == _table(), "regenerate: VITP_WRITE_BAD_INPUTS=1 pytest tests/cli/test_bad_inputs.py"
