#!/usr/bin/env python3
"""Plants each bug of tools/mutation/mutations.py in a scratch copy and reports which the tests catch.

CPU mode (default): copies the work tree (tracked and untracked, not ignored files; uncommitted
edits included) into a scratch folder, configures a CPU build there, builds and runs the tests the
mutations name once unmutated (the baseline: a test that fails already cannot catch anything),
then per mutation: applies the edit, rebuilds only those tests, runs them, restores the file.
A mutation is CAUGHT when at least one of its tests that passed at baseline fails. Exit status 0
only if every CPU mutation was caught. Not part of CI (minutes of builds on 2 cores).

GPU mode (--gpu): builds the tests the GPU mutations name, unmutated and once per mutation, in a
CUDA scratch build (build/mutation_gpu) and packs them into gpu_mutants/ (git-ignored); on the GPU
machine tools/gpu/mutation_check.sh runs them (unmutated must pass, each mutant must fail).

The default scratch folder is build/mutation under the repository root: git ignores build/, and
keeping the same depth below the ccache base dir lets unchanged files hit the cache
(source /root/.ccache_env first). Logs: <scratch>/logs/<mutation>/<test>.log.

    python3 tools/mutation/run_mutations.py                   # every CPU mutation
    python3 tools/mutation/run_mutations.py --only rope_theta_1e-3 bicubic_a_minus_0.75
    python3 tools/mutation/run_mutations.py --gpu                      # builds gpu_mutants/
"""
import argparse
import difflib
import filecmp
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutations import MUTATIONS  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# Ignored paths the tests need, linked into the scratch copy (tests/ref: npm test references).
LINKED = ["tests/ref/node_modules"]
TEST_TIMEOUT_S = 1200


def tree_files(repo):
    """Relative paths of the files git would commit from the work tree (tracked + untracked, not ignored)."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "-co", "--exclude-standard"],
                         check=True, capture_output=True).stdout
    return sorted({p for p in out.decode().split("\0") if p and (repo / p).is_file()})


def sync_tree(repo, scratch):
    """Makes scratch hold exactly the work tree's files (its build/ and logs/ folders kept)."""
    files = tree_files(repo)
    wanted = set(files)
    scratch.mkdir(parents=True, exist_ok=True)
    for path in files:
        source, target = repo / path, scratch / path
        if target.is_file() and not target.is_symlink() and filecmp.cmp(source, target, shallow=False):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    for root, dirs, names in os.walk(scratch):
        rel_root = Path(root).relative_to(scratch)
        if rel_root == Path("."):
            dirs[:] = [d for d in dirs if d not in ("build", "logs")]
        dirs[:] = [d for d in dirs if not (scratch / rel_root / d).is_symlink()]
        for name in names:
            rel = (rel_root / name).as_posix()
            if rel not in wanted and not (scratch / rel).is_symlink():
                (scratch / rel).unlink()
    for rel in LINKED:
        link, source = scratch / rel, repo / rel
        if not source.exists():
            print(f"warning: {rel} is missing here (npm ci in tests/ref): the tests that read it fail at "
                  "baseline and their mutations are reported UNKNOWN", flush=True)
        if source.exists() and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(source)


def mutated_text(mutation, text):
    """The file's text with the mutation applied, or None when it does not apply (with the reason)."""
    if "find" in mutation:
        count = text.count(mutation["find"])
        if count != 1:
            return None, f"the text to replace occurs {count} times (need exactly 1)"
        return text.replace(mutation["find"], mutation["replace"]), ""
    new_text, count = re.subn(mutation["regex"], mutation["replace"], text)
    if count == 0:
        return None, "the pattern matches nothing"
    return new_text, ""


def run(command, log=None, cwd=None, timeout=None):
    """Runs a command; returns (exit status, seconds). Output goes to `log` (a path) or is shown."""
    start = time.time()
    if log is None:
        status = subprocess.run(command, cwd=cwd, timeout=timeout).returncode
    else:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            try:
                status = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                        timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                out.write(f"\n[run_mutations] timed out after {timeout} s\n")
                status = 124
    return status, time.time() - start


def build(build_dir, targets, jobs, log):
    command = ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *targets]
    return run(command, log=log)[0] == 0


def run_tests(build_dir, tests, log_dir):
    """{test: passed} for each test, run one at a time through ctest (its environment and folder)."""
    results = {}
    for test in tests:
        status, seconds = run(["ctest", "--test-dir", str(build_dir), "-R", f"^{re.escape(test)}$",
                               "--output-on-failure", "--timeout", str(TEST_TIMEOUT_S)],
                              log=log_dir / f"{test}.log")
        results[test] = status == 0
        print(f"    {test}: {'passed' if status == 0 else 'FAILED'} ({seconds:.0f} s)", flush=True)
    return results


def cpu_mode(args, mutations):
    scratch = Path(args.scratch).resolve()
    build_dir = scratch / "build" / "cpu"
    logs = scratch / "logs"
    print(f"scratch copy: {scratch}", flush=True)
    sync_tree(REPO, scratch)
    if not (build_dir / "build.ninja").exists():
        status, _ = run(["cmake", "-S", str(scratch), "-B", str(build_dir), "-G", "Ninja",
                         "-DCMAKE_BUILD_TYPE=Release", "-DDELTAMOE_CUDA=OFF"], log=logs / "configure.log")
        if status != 0:
            sys.exit(f"configure failed: see {logs / 'configure.log'}")
    tests = sorted({t for m in mutations for t in m["tests"]})
    # deltamoe too: some tests run the program (DELTAMOE_BINARY).
    print(f"building baseline: {' '.join(tests)} deltamoe", flush=True)
    if not build(build_dir, tests + ["deltamoe"], args.jobs, logs / "baseline" / "build.log"):
        sys.exit(f"the unmutated tree does not build: see {logs / 'baseline' / 'build.log'}")
    print("running baseline", flush=True)
    baseline = run_tests(build_dir, tests, logs / "baseline")

    rows = []
    for mutation in mutations:
        name = mutation["name"]
        print(f"{name}: {mutation['why']}", flush=True)
        # One edit, or several ("also": more edits, for a fault that two guards must both miss).
        edits = {}  # path: [original, mutated] (edits of one file chain)
        for edit in [mutation] + mutation.get("also", []):
            path = scratch / edit["file"]
            if path not in edits:
                text = path.read_text()
                edits[path] = [text, text]
            new_text, reason = mutated_text(edit, edits[path][1])
            if new_text is None:
                break
            edits[path][1] = new_text
        usable = [t for t in mutation["tests"] if baseline[t]]
        if new_text is None:
            rows.append((name, "NOT APPLICABLE", f"{edit['file']}: {reason}"))
            continue
        if not usable:
            rows.append((name, "UNKNOWN", "every test named fails without the mutation: "
                         + ", ".join(mutation["tests"])))
            continue
        try:
            for path, (_, new_text) in edits.items():
                path.write_text(new_text)
            if not build(build_dir, usable + ["deltamoe"], args.jobs, logs / name / "build.log"):
                rows.append((name, "BUILD FAILED", f"see {logs / name / 'build.log'}"))
                continue
            results = run_tests(build_dir, usable, logs / name)
        finally:
            for path, (original, _) in edits.items():
                path.write_text(original)
        failed = [t for t, passed in results.items() if not passed]
        rows.append((name, "CAUGHT" if failed else "MISSED",
                     ("by " + ", ".join(failed)) if failed else "passed: " + ", ".join(usable)))
    # Leave the scratch build matching the tree again (ninja sees the restored files as changed).
    build(build_dir, tests + ["deltamoe"], args.jobs, logs / "restore_build.log")

    print("\nmutation                          result          detail")
    for name, result, detail in rows:
        print(f"{name:<33} {result:<15} {detail}")
    caught = sum(r[1] == "CAUGHT" for r in rows)
    print(f"\n{caught} of {len(rows)} CPU mutations caught; baseline failures: "
          + (", ".join(t for t, ok in baseline.items() if not ok) or "none"))
    return 0 if caught == len(rows) else 1


def gpu_mode(args, mutations):
    """Builds the GPU mutants here (no GPU on this machine) for tools/gpu/mutation_check.sh to run.

    One scratch copy (build/mutation_gpu), one CUDA build in it configured as scripts/gpu_bundle.sh
    configures its own (Release, sm_90a): the named test programs unmutated (base/), then per
    mutation the same programs with the edit (<name>/). Only the mutated file recompiles; every
    other object is a ccache hit when the bundle was built before. Packed with a manifest into
    --mutants (gpu_mutants/: git-ignored, carried to the GPU machine next to gpu_bundle/)."""
    scratch = Path(args.gpu_scratch).resolve()
    build_dir = scratch / "build" / "cuda"
    logs = scratch / "logs"
    staging = scratch / "staging"
    print(f"scratch copy: {scratch}", flush=True)
    sync_tree(REPO, scratch)
    status, _ = run(["cmake", "-S", str(scratch), "-B", str(build_dir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                     "-DDELTAMOE_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={args.arch}"], log=logs / "configure.log")
    if status != 0:
        sys.exit(f"configure failed: see {logs / 'configure.log'}")
    tests = sorted({t for m in mutations for t in m["tests"]})
    shutil.rmtree(staging, ignore_errors=True)

    def build_variant(variant, log_dir):
        if not build(build_dir, tests, args.jobs, log_dir / "build.log"):
            return False
        (staging / "bin" / variant).mkdir(parents=True)
        for test in tests:
            shutil.copy2(build_dir / test, staging / "bin" / variant / test)
            subprocess.run(["strip", str(staging / "bin" / variant / test)], check=True)
        return True

    print(f"building base: {' '.join(tests)}", flush=True)
    if not build_variant("base", logs / "base"):
        sys.exit(f"the unmutated tree does not build: see {logs / 'base' / 'build.log'}")
    manifest = []
    for mutation in mutations:
        name = mutation["name"]
        path = scratch / mutation["file"]
        original = path.read_text()
        new_text, reason = mutated_text(mutation, original)
        if new_text is None:
            sys.exit(f"{name}: NOT APPLICABLE ({reason}): update mutations.py")
        print(f"building {name}: {mutation['why']}", flush=True)
        try:
            path.write_text(new_text)
            if not build_variant(name, logs / name):
                sys.exit(f"{name}: build failed, see {logs / name / 'build.log'}")
        finally:
            path.write_text(original)
        manifest.append(f"{name}\t{' '.join(mutation['tests'])}\t{mutation['why']}")
    build(build_dir, tests, args.jobs, logs / "restore_build.log")

    out = Path(args.mutants).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "tests.txt").write_text("\n".join(tests) + "\n")
    (out / "mutations.tsv").write_text("\n".join(manifest) + "\n")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    (out / "built_from.txt").write_text(f"{commit}{' (with uncommitted edits)' if dirty else ''}\n")
    subprocess.run(["tar", "cJf", str(out / "programs.tar.xz"), "-C", str(staging), "bin"], check=True)
    shutil.copy2(REPO / "tools" / "gpu" / "mutation_check.sh", out / "mutation_check.sh")
    size = (out / "programs.tar.xz").stat().st_size / 2**20
    print(f"\n{out}: {len(mutations)} mutants + base of {', '.join(tests)} ({size:.1f} MiB packed)")
    print("run on the GPU machine from the repository root, carrying gpu_bundle and gpu_mutants: "
          "bash gpu_mutants/mutation_check.sh")
    return 0


def check_mode():
    """Exit 1 when a mutation no longer applies: code that moved would leave its bug unplanted and
    the run would only say NOT APPLICABLE, where nobody looks (the mutations run by hand)."""
    stale = []
    for m in MUTATIONS:
        path = REPO / m["file"]
        if not path.is_file():
            stale.append(f"{m['name']}: {m['file']} does not exist")
            continue
        _, why = mutated_text(m, path.read_text())
        if why:
            stale.append(f"{m['name']}: {m['file']}: {why}")
    for line in stale:
        print("STALE", line)
    print(f"{len(MUTATIONS) - len(stale)} of {len(MUTATIONS)} mutations apply")
    return 1 if stale else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument("--gpu", action="store_true", help="build the GPU mutants into --mutants (no GPU needed)")
    parser.add_argument("--mutants", default=str(REPO / "gpu_mutants"), help="output folder for --gpu")
    parser.add_argument("--gpu-scratch", default=str(REPO / "build" / "mutation_gpu"), help="scratch copy for --gpu")
    parser.add_argument("--arch", default="90a", help="CUDA architecture for --gpu (the H200: 90a)")
    parser.add_argument("--scratch", default=str(REPO / "build" / "mutation"), help="scratch copy folder")
    parser.add_argument("--jobs", type=int, default=2, help="parallel build jobs")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--check", action="store_true",
                        help="only check that every mutation (cpu and gpu) applies to the tree as it is; no build")
    args = parser.parse_args()

    device = "gpu" if args.gpu else "cpu"
    known = {m["name"] for m in MUTATIONS}
    for name in args.only or []:
        if name not in known:
            sys.exit(f"--only {name}: no such mutation; known: {', '.join(sorted(known))}")
    if args.check:
        return check_mode()
    if args.list:
        for m in MUTATIONS:
            print(f"{m['name']:<33} {m['device']}  {m['file']}: {m['why']} -> {', '.join(m['tests'])}")
        return 0
    chosen = [m for m in MUTATIONS if m["device"] == device and (not args.only or m["name"] in args.only)]
    if not chosen:
        sys.exit(f"no {device} mutation selected")
    return gpu_mode(args, chosen) if args.gpu else cpu_mode(args, chosen)


if __name__ == "__main__":
    sys.exit(main())
