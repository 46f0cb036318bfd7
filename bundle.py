"""python -m bundle: one folder holding exactly what predicting needs on a machine with no network, such
as a Kaggle code competition's notebook (notebooks/kaggle.ipynb), to upload as one Kaggle dataset.

    python -m bundle kaggle-bundle                      # the folds of this run, wheels for this Python
    python -m bundle kaggle-bundle --student small      # a distilled student alone
    python -m bundle kaggle-bundle --python 3.12        # wheels for the notebook's Python

The folder holds the trained models with their pipeline.json (how the run read, cleaned and tokenized its
texts), the submission's form (data/processed) and, for multi-label, the threshold evaluate chose, the
project's modules python -m predict imports (found from its import statements) and wheels/: a wheel of every
package those modules need and of what those need in turn, at the versions installed here, for Linux on
x86-64 and the named Python, downloaded by pip, with requirements.txt pinning the ones predict imports.
torch is left to the notebook's machine: Kaggle's image has a CUDA build. Inside the folder,
`python -m predict test.csv --out submission.csv` runs as it runs here.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pipeline.command import run_main
from pipeline.outputs import atomic_dir
from pipeline.settings import PipelineError
from predicting.bundling import PROVIDED, distributions_of, needed_code, platform_tags, requirement_closure
from predicting.inference import fold_folders, read_run

ROOT = Path(__file__).resolve().parent
RUN_FILES = ["data/processed/submission.json", "data/processed/shape.json", "reports/evaluate/metrics.json"]
PLATFORM = "manylinux_2_35_x86_64"  # Kaggle's and Colab's images: Ubuntu 22.04, glibc 2.35


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bundle", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to write (new, or empty)")
    parser.add_argument("--models", type=Path, default=Path("models"), help="the trained folds (default: models)")
    parser.add_argument("--student", help="a distilled student (a key of distill.students) instead of the folds")
    parser.add_argument("--python", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                        help="the Python version of the machine that predicts (default: this one's)")
    parser.add_argument("--platform", default=PLATFORM, help=f"its platform tag (default: {PLATFORM})")
    return parser.parse_args(argv)


def model_folders(args):
    """{trained folder here: where python -m predict looks for it in the bundle}."""
    if args.student:
        folder = Path("students/distill") / args.student / "model"
        read_run(folder)
        return {folder: folder}
    return {folder: Path("models") / folder.name for folder in fold_folders(args.models)[0]}


def download_wheels(pins, folder, python, platform):
    """pip download of exactly these versions, wheels only, for the target; a one-line error naming what has
    no wheel there (or what the index could not give)."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp", "--dest", str(folder),
               *[option for tag in platform_tags(platform) for option in ("--platform", tag)],
               *[f"{name}=={version}" for name, version in pins.items()]]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        failed = next((line for line in result.stderr.splitlines() if line.startswith("ERROR")), result.stderr.strip())
        raise PipelineError(f"pip download for Python {python} on {platform}: {failed}; check the network or the "
                            "index (pip's own settings apply), or name another --python or --platform")


def main():
    args = parse_args(sys.argv[1:])
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise PipelineError(f"{args.out} exists and is not an empty folder: name a new one")
    models = model_folders(args)
    code, imported = needed_code(ROOT)
    roots = [name for name in distributions_of(imported) if name not in PROVIDED]
    pins = requirement_closure(roots, args.python)
    print(f"bundling {len(models)} model(s), {len(code)} modules of code and {len(pins)} packages for Python "
          f"{args.python} on {args.platform}")
    with atomic_dir(args.out) as tmp:
        for folder, inside in models.items():
            shutil.copytree(folder, tmp / inside)
        files = {ROOT / name: name for name in code} | {Path(name): name for name in RUN_FILES if Path(name).is_file()}
        for source, name in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tmp / name)
        wheels = tmp / "wheels"
        wheels.mkdir()
        download_wheels(pins, wheels, args.python, args.platform)
        (wheels / "requirements.txt").write_text("".join(f"{name}=={pins[name]}\n" for name in roots))
        (tmp / "bundle.json").write_text(json.dumps({
            "python": args.python, "platform": args.platform, "models": [str(f) for f in models.values()],
            "student": args.student, "packages": pins, "left_to_the_machine": sorted(PROVIDED),
            "predict": "python -m predict TEST.csv --out submission.csv" + (f" --student {args.student}" if args.student else ""),
        }, indent=1) + "\n")
    print(f"upload {args.out} as one Kaggle dataset (`kaggle datasets create -p {args.out} --dir-mode zip`, or the web "
          "page's New Dataset), and predict with it in notebooks/kaggle.ipynb")
    return [args.out]


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    run_main(main, tool="bundle")
