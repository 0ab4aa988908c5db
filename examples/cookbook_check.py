"""Check that tinker-cookbook's own recipes run, unchanged, against Twinkle's Tinker HTTP front.

Run: `make cookbook-check` (it builds `.venv-cookbook` with tinker-cookbook and the stock
`tinker` SDK, then runs this file with that venv's python). By hand, after `make setup`:

    .venv-cookbook/bin/python examples/cookbook_check.py                  # every part
    .venv-cookbook/bin/python examples/cookbook_check.py --only rl_loop_gspo,step_column
    .venv-cookbook/bin/python examples/cookbook_check.py --list

It starts `.venv/bin/twinkle-server serve --models models.toml --http-port 0` (the project's
venv; nothing of twinkle is imported here) with two base models: `tiny` as the students
(`Qwen/Qwen3-4B-Instruct-2507`, and distillation's default `Qwen/Qwen3.5-9B-Base`) and
`tiny-large`, another shape, as the teachers and graders (distillation's default teacher
`Qwen/Qwen3.5-9B`, rubric's default grader `Qwen/Qwen3.6-35B-A3B`; role sample). It then runs each part
in its own python process against it (a part that hangs is killed after its time limit and
fails; the others still run). The cookbook's code is imported and called as it ships; only
its inputs are made local, through the cookbook's own extension points:

* the model: the server's tiny model answers to `Qwen/Qwen3-4B-Instruct-2507`, whose
  recommended renderer (`qwen3_instruct`, ChatML without <think>) is the tiny model's chat
  template; the tokenizer the server names in `get_info` (a local directory, shared by both
  tiny models) is registered under every served name with
  `tokenizer_utils.register_tokenizer`;
* datasets: `openai/gsm8k` is read from `examples/cookbook_data/gsm8k-*.jsonl` (GSM8K's
  columns, a few easy problems), `Anthropic/hh-rlhf` from `hh-rlhf-*.jsonl` (its
  `chosen`/`rejected` columns, a few made-up pairs) and `zwhe99/DeepMath-103K` from
  `deepmath-train.jsonl` (its columns, eight easy questions) and `hicai-zju/SciKnowEval` from
  `sciknoweval-test.jsonl` (its columns, twelve made-up chemistry MCQs) through
  `datasets.load_dataset`, which is
  replaced, for the check's process only, by a loader of those files that refuses any other
  name; the recipes that take a file path get one there: `prophet-arena.csv` (Prophet
  Arena's columns, five made-up markets either side of the recipe's split date) and
  `rubric-*.jsonl` (the rubric recipe's datapoint format);
* the recipes' default teacher and grader names are answered by `tiny-large`, and
  `TINKER_BASE_URL` points the recipes that
  build a `ServiceClient` without a `base_url` (guess_number, rubric's grader) at the server;
* HF_HUB_OFFLINE=1 (and the datasets/transformers equivalents): any download fails loudly;
* a warm start: a random tiny model never writes `\\boxed{...}`, so every group's rewards
  would be equal and `rl_loop` would skip every training step. The check trains an adapter
  with the cookbook's `conversation_to_datum` to answer `\\boxed{1}` or `\\boxed{2}` (half
  right on the local GSM8K rows), saves its state, and hands it to the recipes the way they
  resume: a `checkpoints.jsonl` record in `rl_loop`'s log dir, `load_checkpoint_path` for
  `math_rl`.

Parts (each prints one summary line; `--only` takes a comma-separated list):

* supervised: conversations -> datums with the cookbook's renderer and
  `conversation_to_datum`; `forward_backward(cross_entropy)` + `optim_step`; NLL goes down.
* toy_rl: `ProblemEnv` rollouts with `do_group_rollout`, `compute_advantages`,
  `assemble_training_data`, `rl.train.train_step(importance_sampling)`; sampler and trainer
  logprobs agree.
* rl_loop_is, rl_loop_stable_reinforce (its default loss), rl_loop_gspo:
  `recipes/rl_loop.main(Config(...))`, 3 steps of 2 problems x 8 samples.
* math_rl_sync, math_rl_async: `recipes/math_rl/train.cli_main(CLIConfig(...))` with its
  defaults (env `arithmetic`, loss `stable_reinforce`), 2 steps of 2 groups; async is
  `max_steps_off_policy=1` (its `AsyncConfig`).
* math_rl_gsm8k: the same, sync, `env="gsm8k"` on the local rows, from the warm start.
* weights_download: `save_weights_external` then `tinker_cookbook.weights.download` of its
  `tinker://.../external_weights/...` path, and `weights.download` of a `save_state` path
  (the cookbook exports it encrypted with age and decrypts); both directories hold a PEFT
  adapter (`adapter_config.json`, LoRA tensors in `adapter_model.safetensors`), and the
  first, loaded by `peft.PeftModel.from_pretrained` in the project's venv, gives the
  server's logprobs.
* renderers: the cookbook's qwen3, qwen3_disable_thinking, qwen3_instruct, qwen3_5,
  qwen3_5_disable_thinking, llama3 and gpt-oss renderers built on the tiny tokenizer (their
  single-token asserts: `</think>`, `<|eot_id|>`, `<|return|>`, `<|call|>`, ...), each
  rendering a prompt and a supervised example and parsing a reply in its own format.
* dpo: `recipes/preference/dpo/train.cli_main` (dataset `hhh`), 2 steps of 2 pairs; the
  reference is the initial weights' sampling client, which the server keeps for the session.
* decisions_forecasting: `recipes/decisions/forecasting.main` (Brier loss through
  `forward_backward_custom` on (T, K) choice targets, validation by `sample_decision`),
  2 steps of 2 markets.
* rubric: `recipes/rubric/train.cli_main` with its default renderers
  (`qwen3_5_disable_thinking` for policy and grader), 2 steps of 1 group x 2; the grader
  is its default name, served by `tiny-large`, its reply capped at 48 tokens (the recipe
  asks 2048 and an untrained grader never stops); it seldom writes `<score>`, so rewards
  are mostly 0.
* sdft: `recipes/sdft/train.cli_main` with its defaults (Qwen3-8B, sciknoweval Chemistry,
  top-20 self-distillation through `topk_prompt_logprobs`) on twelve local MCQ rows, 2
  steps of 2 questions.
* distillation: `recipes/distillation/on_policy_distillation.cli_main` with its default
  student, teacher, dataset (deepmath), loss and KL penalty, 2 steps of 2 prompts x 2; the
  teacher's logprobs run on `tiny-large`'s own engine (checked in the server log).
* guess_number: `recipes/multiplayer_rl/guess_number` (`build_config` + `rl.train.main`, as
  its `__main__`), multi-turn games with `qwen3_5_disable_thinking`, 2 steps.
* sl_loop_moe, sl_loop_hybrid: `recipes/sl_loop.main(Config(...))` (local no_robots
  rows, 3 steps of 2) on a tiny Qwen3 MoE served as `Qwen/Qwen3-30B-A3B-Instruct-2507`
  (LoRA per expert) and on a tiny Qwen3.5 hybrid (Gated DeltaNet beside full attention)
  served as `Qwen/Qwen3.5-4B`, both by the same server, sampled in its decode pool. Each
  family model is built offline by `python -m tests.engine.families` in the project's venv.
  The final checkpoint samples, the trainer scores the sampled tokens alike, and its
  `save_weights_external` loads in PEFT with the server's logprobs.
* step_column: `rl_loop` (importance_sampling) logs through the cookbook's `ml_log`; the
  `step` column of its `metrics.jsonl` must be the integers 0, 1, 2 (the loop merges the
  server's `optim_step` metrics into its own before logging), and so must that of every
  sync recipe run earlier in the same invocation.

Exits non-zero if any part fails; the server is stopped with SIGTERM either way.
"""

from __future__ import annotations

import os

# Before anything imports huggingface_hub, datasets or transformers: nothing may download.
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_var] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / ".venv" / "bin" / "twinkle-server"
DATA = ROOT / "examples" / "cookbook_data"
# A name the cookbook knows whose recommended renderer is the tiny model's chat template.
MODEL = "Qwen/Qwen3-4B-Instruct-2507"
RENDERER = "qwen3_instruct"  # model_info's first choice for MODEL
# The recipes' own default model names, each answered by a local model: the students by
# `tiny`, the teachers and graders by `tiny-large` (another base, role sample), so a
# recipe's teacher runs on its own engine beside the student.
# distillation's and sdft's default students
STUDENT_NAMES = (MODEL, "Qwen/Qwen3.5-9B-Base", "Qwen/Qwen3-8B")
TEACHER = "Qwen/Qwen3.5-9B"                        # distillation's default teacher
GRADER = "Qwen/Qwen3.6-35B-A3B"                    # rubric's default grader_llm_name
MODELS_FILE = f"""
[[models]]
name = "{STUDENT_NAMES[0]}"
path = "tiny"
aliases = {list(STUDENT_NAMES[1:])}

[[models]]
name = "{TEACHER}"
path = "tiny-large"
aliases = ["{GRADER}"]
role = "sample"
"""
API_KEY = "tml-local"        # the server is open; the SDK only wants the `tml-` prefix
# The families of issue 44: a tiny random model of each (the project's venv builds them
# offline: `python -m tests.engine.families`), served by the same server under a name the
# cookbook knows, and sampled in its decode pool (the hybrid's recurrent states too).
MOE_MODEL = "Qwen/Qwen3-30B-A3B-Instruct-2507"
HYBRID_MODEL = "Qwen/Qwen3.5-4B"
FAMILY_OF = {MOE_MODEL: "qwen3_moe", HYBRID_MODEL: "qwen3_5_text"}

# --------------------------------------------------------------------------------------
# Parent: start the server, run each part in a child process, summarise.
# --------------------------------------------------------------------------------------

# name -> (time limit in seconds, what it runs). Each takes 5-40 s on 2 cores; a limit is
# there for a hang (an SDK retrying a request the server never answers).
PARTS: dict[str, tuple[int, str]] = {
    "supervised": (120, "cookbook SFT step: conversation_to_datum, cross_entropy, NLL down"),
    "toy_rl": (120, "cookbook RL pieces: do_group_rollout, compute_advantages, train_step(IS)"),
    "rl_loop_is": (240, "recipes/rl_loop.py main(), loss_fn=importance_sampling (smoke)"),
    "rl_loop_stable_reinforce": (240, "recipes/rl_loop.py main(), its default loss"),
    "rl_loop_gspo": (240, "recipes/rl_loop.py main(), loss_fn=gspo"),
    "math_rl_sync": (180, "recipes/math_rl/train.py cli_main(), defaults: arithmetic, "
                     "stable_reinforce"),
    "math_rl_async": (180, "recipes/math_rl/train.py cli_main(), defaults, "
                      "max_steps_off_policy=1"),
    "math_rl_gsm8k": (240, "recipes/math_rl/train.py cli_main(), env=gsm8k on local rows"),
    "weights_download": (240, "save_weights_external + tinker_cookbook.weights.download"),
    "renderers": (120, "the cookbook's Qwen3/3.5, Llama 3 and gpt-oss renderers on the tiny "
                  "tokenizer: single-token asserts, prompts, supervised examples, parsing"),
    "dpo": (240, "recipes/preference/dpo/train.py cli_main(), dataset=hhh on local rows"),
    "decisions_forecasting": (180, "recipes/decisions/forecasting.py main(): Brier loss "
                              "through forward_backward_custom, local markets"),
    "rubric": (240, "recipes/rubric/train.py cli_main(): Qwen3.5 renderer, the server's "
               "model as grader, local rubrics"),
    "distillation": (240, "recipes/distillation/on_policy_distillation cli_main(): its "
                          "default student and teacher, two bases, dataset deepmath"),
    "sdft": (240, "recipes/sdft/train.py cli_main(): its defaults (Qwen3-8B, sciknoweval, "
                  "top-20 self-distillation) on local rows"),
    "guess_number": (240, "recipes/multiplayer_rl/guess_number: multi-turn env, Qwen3.5 "
                     "renderer (qwen3_5_disable_thinking)"),
    "step_column": (240, "the `step` column of the recipes' metrics.jsonl is 0, 1, 2, ..."),
    "sl_loop_moe": (240, f"recipes/sl_loop.py main() on a tiny Qwen3 MoE ({MOE_MODEL}: "
                    "LoRA per expert); its weights sample in the pool and export to PEFT"),
    "sl_loop_hybrid": (240, f"recipes/sl_loop.py main() on a tiny Qwen3.5 hybrid "
                       f"({HYBRID_MODEL}: Gated DeltaNet beside full attention); its weights "
                       "sample in the pool and export to PEFT"),
}


def family_models(out: Path) -> dict[str, str]:
    """Build the tiny family models under `out` with the project's venv; name -> directory."""
    built = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), "-m", "tests.engine.families", str(out),
         *FAMILY_OF.values()], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if built.returncode != 0:
        raise RuntimeError(f"could not build the family models:\n{built.stderr[-3000:]}")
    dirs = built.stdout.split()
    return {name: dirs[i] for i, name in enumerate(FAMILY_OF)}


def start_server(data_dir: Path, models_file: str,
                 timeout_s: float = 180) -> tuple[subprocess.Popen, str]:
    """Start the server on `data_dir` serving `models_file` (TOML); return it and the
    `HOST:PORT` of its HTTP front."""
    log_path = data_dir / "server.log"
    # COOKBOOK_CHECK_SERVER: another server command (e.g. another checkout's), shlex-split.
    server = shlex.split(os.environ.get("COOKBOOK_CHECK_SERVER", "")) or [str(SERVER)]
    models = data_dir / "models.toml"
    models.write_text(models_file)
    proc = subprocess.Popen(
        [*server, "serve", "--models", str(models), "--port", "0", "--http-port", "0", "--data-dir", str(data_dir),
         # Each part is its own process with its own sessions and adapters.
         "--max-adapters", "64", "--max-adapters-per-tenant", "64"],
        stdout=log_path.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log_path.read_text()
        # Both lines: `listening on` comes once the gRPC side serves too.
        http = re.search(r"^http listening on (\S+)$", text, re.M)
        if http and re.search(r"^listening on ", text, re.M):
            return proc, http.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{text}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start in {timeout_s}s:\n{log_path.read_text()}")


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)  # drains, then exits
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def run_part(name: str, base_url: str, work: Path, timeout_s: int) -> dict[str, Any]:
    """Run one part in a child process; return its result record."""
    log = work / f"part-{name}.log"
    result_file = work / f"part-{name}.json"
    t0 = time.monotonic()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name,
           "--base-url", base_url, "--work", str(work)]
    with log.open("w") as out:
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the child and anything it started
            child.wait()
            rc = None
    elapsed = time.monotonic() - t0
    if result_file.exists():
        result = json.loads(result_file.read_text())
    elif rc is None:
        result = {"ok": False, "summary": f"timed out after {timeout_s}s (killed)"}
    else:
        result = {"ok": False, "summary": f"child exited {rc} without a result"}
    if rc is None and result.get("ok"):
        result = {"ok": False, "summary": f"timed out after {timeout_s}s after reporting"}
    result["seconds"] = elapsed
    result["log"] = str(log)
    return result


def parent(only: list[str], keep: bool) -> int:
    for dist in ("tinker-cookbook", "tinker", "transformers", "torch", "datasets"):
        print(f"{dist} {importlib.metadata.version(dist)}")
    unknown = [p for p in only if p not in PARTS]
    if unknown:
        print(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    selected = [p for p in PARTS if not only or p in only]
    tmp = Path(tempfile.mkdtemp(prefix="cookbook-check-"))
    results: dict[str, dict[str, Any]] = {}
    t_all = time.monotonic()
    work = tmp / "work"
    work.mkdir()
    models = family_models(tmp / "models")
    (work / "family_models.json").write_text(json.dumps(models))
    proc, http_address = start_server(tmp, MODELS_FILE + "".join(
        f'\n[[models]]\nname = "{name}"\npath = "{path}"\n' for name, path in models.items()))
    print(f"server pid {proc.pid}, http front {http_address}, data dir {tmp}", flush=True)
    try:
        for name in selected:
            timeout_s = PARTS[name][0]
            print(f"-- {name}: {PARTS[name][1]}", flush=True)
            r = run_part(name, f"http://{http_address}", work, timeout_s)
            results[name] = r
            status = "PASS" if r["ok"] else "FAIL"
            print(f"{status} {name} ({r['seconds']:.1f}s): {r['summary']}", flush=True)
            if not r["ok"]:
                tail = Path(r["log"]).read_text(errors="replace").splitlines()[-40:]
                print("   | " + "\n   | ".join(tail), flush=True)
    finally:
        rc = stop_server(proc)
        print(f"server stopped (SIGTERM), exit code {rc}", flush=True)
        failed = [n for n, r in results.items() if not r["ok"]]
        if failed or rc != 0:
            server_log = (tmp / "server.log").read_text(errors="replace")
            print(f"--- server log (tail) ---\n{server_log[-3000:]}", file=sys.stderr)
        if keep or failed:
            print(f"logs kept in {tmp}")
        else:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n== cookbook-check summary ({time.monotonic() - t_all:.0f}s)")
    for name, r in results.items():
        print(f"  {'PASS' if r['ok'] else 'FAIL'}  {name:26s} {r['seconds']:6.1f}s  {r['summary']}")
    if failed or rc != 0 or len(results) != len(selected):
        print(f"cookbook-check: FAILED ({', '.join(failed) or 'server exit code'})")
        return 1
    print("cookbook-check: OK")
    return 0


# --------------------------------------------------------------------------------------
# Child: one part, in its own process.
# --------------------------------------------------------------------------------------

# rl_loop's few-shot prefix and question suffix (its main() builds them inline): the warm
# start answers prompts shaped like the recipe's.
QUESTION_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
CONVO_PREFIX = [
    {"role": "user", "content": "How many r's are in strawberry?" + QUESTION_SUFFIX},
    {"role": "assistant", "content": "Let's spell the word out and number all the letters: "
     "1) s 2) t 3) r 4) a 5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, "
     "and 9. \\boxed{3}"},
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."}],
    [{"role": "user", "content": "Name a primary colour."},
     {"role": "assistant", "content": "Red."}],
    [{"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Say hello."},
     {"role": "assistant", "content": "Hello."}],
]


class Ctx:
    """What a part gets: the server's URL, a scratch dir shared by the parts, the spy."""

    def __init__(self, base_url: str, work: Path):
        self.base_url = base_url
        self.work = work
        self.family_models: dict[str, str] = json.loads(
            (work / "family_models.json").read_text())
        self.fwd_bwd_calls: list[tuple[str, int]] = []  # (loss_fn, datums) per request

    def losses(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for loss, _ in self.fwd_bwd_calls:
            out[loss] = out.get(loss, 0) + 1
        return out


def local_inputs(ctx: Ctx) -> None:
    """Point the cookbook's tokenizer and dataset loading at local inputs."""
    import datasets
    import tinker
    from tinker_cookbook.tokenizer_utils import get_tokenizer, register_tokenizer

    # The tokenizer: the server names its own (a local directory for `tiny`) in get_info.
    tokenizer_dir = ctx.work / "tokenizer_id.txt"
    if not tokenizer_dir.exists():
        service = tinker.ServiceClient(base_url=ctx.base_url)
        tc = service.create_lora_training_client(base_model=MODEL, rank=8)
        tokenizer_id = tc.get_info().model_data.tokenizer_id
        assert tokenizer_id and Path(tokenizer_id).is_dir(), f"tokenizer_id {tokenizer_id!r}"
        tokenizer_dir.write_text(tokenizer_id)
    local_tokenizer = get_tokenizer(tokenizer_dir.read_text())  # a directory: no hub
    for name in (*STUDENT_NAMES, TEACHER, GRADER):   # both tiny models share one tokenizer
        register_tokenizer(name, lambda: local_tokenizer)
    for name, path in ctx.family_models.items():       # served under hub names: their own
        register_tokenizer(name, lambda path=path: get_tokenizer(path))

    # Datasets: the local GSM8K rows; any other name is refused (no silent download).
    real_load = datasets.load_dataset
    local = {"openai/gsm8k": {"train": DATA / "gsm8k-train.jsonl",
                              "test": DATA / "gsm8k-test.jsonl"},
             # hh-rlhf's columns (`chosen`, `rejected`: "\n\nHuman: ...\n\nAssistant: ...").
             "Anthropic/hh-rlhf": {"train": DATA / "hh-rlhf-train.jsonl",
                                   "test": DATA / "hh-rlhf-test.jsonl"},
             # DeepMath-103K's columns (`question`, `final_answer`, `difficulty`).
             "zwhe99/DeepMath-103K": {"train": DATA / "deepmath-train.jsonl"},
             # SciKnowEval's columns (`domain`, `details.level`, `type`, `question`,
             # `choices`, `answerKey`); sdft filters Chemistry L3 MCQs from its test split.
             "hicai-zju/SciKnowEval": {"test": DATA / "sciknoweval-test.jsonl"},
             # no_robots' columns (`prompt`, `prompt_id`, `messages`, `category`).
             "HuggingFaceH4/no_robots": {"train": DATA / "no_robots-train.jsonl"}}

    def load_dataset(path: str, name: str | None = None, *, split: str | None = None,
                     **kwargs: Any):
        if path not in local:
            raise RuntimeError(f"cookbook-check: dataset {path!r} has no local copy")
        files = {k: str(v) for k, v in local[path].items()}
        ds = real_load("json", data_files=files)
        return ds[split] if split is not None else ds

    datasets.load_dataset = load_dataset
    from tinker_cookbook.distillation import datasets as distillation_datasets
    from tinker_cookbook.recipes.math_rl import math_env
    math_env.load_dataset = load_dataset  # imported by name there
    distillation_datasets.load_dataset = load_dataset
    from tinker_cookbook.recipes.sdft import datasets as sdft_datasets
    sdft_datasets.load_dataset = load_dataset


def install_spy(ctx: Ctx) -> None:
    """Record every forward_backward the SDK sends (loss name, datums); changes nothing."""
    import tinker
    cls = tinker.TrainingClient
    real = cls.forward_backward

    def forward_backward(self, data, loss_fn, loss_fn_config=None):
        ctx.fwd_bwd_calls.append((str(loss_fn), len(data)))
        return real(self, data, loss_fn, loss_fn_config)

    cls.forward_backward = forward_backward


def renderer_and_tokenizer():
    from tinker_cookbook import model_info, renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer
    assert model_info.get_recommended_renderer_name(MODEL) == RENDERER
    tokenizer = get_tokenizer(MODEL)
    renderer = renderers.get_renderer(RENDERER, tokenizer)
    # The renderer's prompt must be the model's own chat template, token for token.
    prompt = CONVERSATIONS[3][:2]
    assert renderer.build_generation_prompt(prompt).to_ints() == tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=False), RENDERER
    return renderer, tokenizer


def local_rows(split: str = "train") -> list[dict[str, str]]:
    return [json.loads(line) for line in (DATA / f"gsm8k-{split}.jsonl").read_text().splitlines()]


def warm_start(ctx: Ctx) -> str:
    """A saved state that answers `\\boxed{1}` or `\\boxed{2}` about evenly; its tinker path.

    Made once per invocation (the first part that needs it) and shared through `ctx.work`.
    """
    marker = ctx.work / "warm_start.txt"
    if marker.exists():
        return marker.read_text()
    import tinker
    from tinker_cookbook.supervised.common import compute_mean_nll
    from tinker_cookbook.supervised.data import conversation_to_datum
    renderer, _ = renderer_and_tokenizer()
    data = []
    for row in local_rows()[:4]:
        convo = [*CONVO_PREFIX, {"role": "user", "content": row["question"] + QUESTION_SUFFIX}]
        for answer in ("1", "2"):
            data.append(conversation_to_datum(
                [*convo, {"role": "assistant", "content": f"\\boxed{{{answer}}}"}],
                renderer, max_length=1024))
    service = tinker.ServiceClient(base_url=ctx.base_url)
    tc = service.create_lora_training_client(base_model=MODEL, rank=32, seed=0)
    adam = tinker.AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8)
    nll, steps = float("nan"), 0
    while steps < 100:
        steps += 1
        fb = tc.forward_backward(data, loss_fn="cross_entropy")
        tc.optim_step(adam).result()
        nll = compute_mean_nll([o["logprobs"] for o in fb.result().loss_fn_outputs],
                               [d.loss_fn_inputs["weights"] for d in data])
        # Floor: a fair coin on one of the answer's 8 tokens, ln(2)/8 = 0.087 per token.
        if nll < 0.15:
            break
    assert nll < 0.3, f"warm start did not learn to answer \\boxed{{1|2}}: mean NLL {nll:.3f}"
    print(f"warm start: {steps} SFT steps, mean NLL {nll:.4f}", flush=True)
    path = tc.save_state("warm-start").result().path
    marker.write_text(path)
    return path


def metrics_rows(log_path: Path) -> list[dict[str, Any]]:
    f = log_path / "metrics.jsonl"
    assert f.exists(), f"no {f}"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def check_steps(log_path: Path, row_key: str, expected: int) -> list[Any]:
    """The logged `step` column: the loop's own integer counter, 0, 1, 2, ...

    Every row's `step` is an int, the rows never go back a step, and the training rows (those
    with `row_key`) are steps 0 .. expected-1, one each. `rl.train` adds rows of its own at
    the last step (final eval, final checkpoint): they count for the first two checks only.
    """
    rows = metrics_rows(log_path)
    steps = [r["step"] for r in rows if "step" in r]
    trained = [r.get("step") for r in rows if row_key in r]
    ok = (all(type(s) is int for s in steps) and steps == sorted(steps)
          and trained == list(range(expected)))
    assert ok, (f"{log_path.name}/metrics.jsonl: step column {steps!r}, training rows at "
                f"{trained!r}; expected integers, training rows at {list(range(expected))} "
                f"(a float or shifted step means the server's optim_step metrics overwrote "
                f"the loop's own `step`)")
    return trained


# -- parts ----------------------------------------------------------------------------------

def part_supervised(ctx: Ctx) -> str:
    import tinker
    from tinker_cookbook.supervised.common import compute_mean_nll
    from tinker_cookbook.supervised.data import conversation_to_datum
    renderer, _ = renderer_and_tokenizer()

    async def go() -> list[float]:
        service = tinker.ServiceClient(base_url=ctx.base_url)
        tc = await service.create_lora_training_client(MODEL, rank=8, seed=0)
        data = [conversation_to_datum(c, renderer, max_length=256) for c in CONVERSATIONS]
        adam = tinker.AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8)
        nlls: list[float] = []
        for _step in range(8):
            fwd_bwd_future = tc.forward_backward(data, loss_fn="cross_entropy")
            optim_future = tc.optim_step(adam)
            fwd_bwd, _ = await fwd_bwd_future, await optim_future
            nlls.append(compute_mean_nll([o["logprobs"] for o in fwd_bwd.loss_fn_outputs],
                                         [d.loss_fn_inputs["weights"] for d in data]))
        return nlls

    nlls = asyncio.run(go())
    assert all(math.isfinite(x) for x in nlls), nlls
    assert nlls[-1] < nlls[0], f"SFT loss did not go down: {nlls}"
    return f"8 steps, NLL {nlls[0]:.3f} -> {nlls[-1]:.3f}"


def part_toy_rl(ctx: Ctx) -> str:
    import tinker
    import torch
    from tinker_cookbook import renderers
    from tinker_cookbook.completers import TinkerTokenCompleter
    from tinker_cookbook.rl.data_processing import assemble_training_data, compute_advantages
    from tinker_cookbook.rl.metrics import compute_kl_sample_train
    from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
    from tinker_cookbook.rl.rollouts import do_group_rollout
    from tinker_cookbook.rl.train import train_step
    renderer, _ = renderer_and_tokenizer()

    class LetterEnv(ProblemEnv):
        """Toy single-turn task: correct when the reply contains the letter 'e'."""

        def __init__(self, renderer: renderers.Renderer, question: str):
            super().__init__(renderer, format_coef=0.1)
            self.question = question

        def get_question(self) -> str:
            return self.question

        def check_answer(self, sample_str: str) -> bool:
            return "e" in sample_str

        def check_format(self, sample_str: str) -> bool:
            return sample_str.strip() != ""

        def get_reference_answer(self) -> str:
            return "any reply with an 'e'"

    async def go() -> str:
        service = tinker.ServiceClient(base_url=ctx.base_url)
        tc = await service.create_lora_training_client(MODEL, rank=8, seed=0)
        questions = ["Say something.", "Name a fruit."]
        group_size = 4
        kl: dict[str, float] = {}
        for it in range(3):
            sampling_client = await tc.save_weights_and_get_sampling_client()
            policy = TinkerTokenCompleter(sampling_client, max_tokens=16, temperature=1.0)
            builders = [ProblemGroupBuilder(lambda q=q: LetterEnv(renderer, q), group_size)
                        for q in questions]
            groups = await asyncio.gather(*(do_group_rollout(b, policy) for b in builders))
            advantages = compute_advantages(groups)
            data, _ = assemble_training_data(groups, advantages)
            logprobs = await train_step(data, tc, learning_rate=1e-3, num_substeps=1,
                                        loss_fn="importance_sampling")
            kl = compute_kl_sample_train(data, logprobs)  # sampler vs trainer, action tokens
            loss = -sum(float((torch.exp(lp - d.loss_fn_inputs["logprobs"].to_torch())
                               * d.loss_fn_inputs["advantages"].to_torch()).sum())
                        for d, lp in zip(data, logprobs, strict=True))
            rewards = [r for g in groups for r in g.get_total_rewards()]
            print(f"rl iter {it}: mean reward {sum(rewards) / len(rewards):.3f}, "
                  f"IS loss {loss:.4f}, kl v2 {kl['optim/kl_sample_train_v2']:.2e}", flush=True)
            assert len(logprobs) == len(data) == len(questions) * group_size
            assert all(math.isfinite(x) for x in [*rewards, loss, *kl.values()])
            # The sampler and the trainer score the sampled tokens alike.
            assert kl["optim/kl_sample_train_v2"] < 1e-3, kl
        return f"3 iterations, kl(sample||train) v2 {kl['optim/kl_sample_train_v2']:.1e}"

    return asyncio.run(go())


def write_resume_record(log_path: Path, state_path: str) -> None:
    """The record `checkpoint_utils.save_checkpoint` appends, so the loop resumes from it."""
    from tinker_cookbook.checkpoint_utils import CheckpointRecord
    log_path.mkdir(parents=True)
    record = CheckpointRecord(name="warm-start", batch=0, state_path=state_path)
    (log_path / "checkpoints.jsonl").write_text(json.dumps(record.to_dict()) + "\n")


RL_LOOP_STEPS, MATH_RL_STEPS = 3, 2
RL_LOOP_ROW = "reward/total"          # a key rl_loop logs once per step
RL_TRAIN_ROW = "env/all/reward/total"  # a key rl.train logs once per training step
DISTILL_ROW = "teacher_kl"  # what train_on_policy logs per step: the student-teacher KL


def rl_loop(ctx: Ctx, loss_fn: str | None, name: str,
            steps: int = RL_LOOP_STEPS) -> tuple[str, Path]:
    from tinker_cookbook.recipes import rl_loop as recipe
    state = warm_start(ctx)
    log_path = ctx.work / name
    write_resume_record(log_path, state)
    kwargs: dict[str, Any] = {} if loss_fn is None else {"loss_fn": loss_fn}
    config = recipe.Config(base_url=ctx.base_url, log_path=str(log_path), model_name=MODEL,
                           batch_size=2, group_size=8, max_tokens=16, max_steps=steps,
                           **kwargs)
    loss = config.loss_fn
    recipe.main(config)
    rows = [r for r in metrics_rows(log_path) if RL_LOOP_ROW in r]
    assert len(rows) == steps, f"{len(rows)} logged steps, expected {steps}"
    trained = ctx.losses().get(loss, 0)
    assert trained >= 1, (f"no forward_backward with {loss} (every group's rewards were "
                          f"equal: {[r['reward/total'] for r in rows]})")
    assert set(ctx.losses()) <= {loss, "cross_entropy"}, ctx.losses()
    rewards = ", ".join(f"{r['reward/total']:.2f}" for r in rows)
    return f"loss {loss}: {steps} steps, {trained} trained, mean reward per step {rewards}", log_path


def part_rl_loop_is(ctx: Ctx) -> str:
    return rl_loop(ctx, "importance_sampling", "rl_loop_is")[0]


def part_rl_loop_stable_reinforce(ctx: Ctx) -> str:
    from tinker_cookbook.recipes import rl_loop as recipe
    assert recipe.Config().loss_fn == "stable_reinforce", recipe.Config().loss_fn
    return rl_loop(ctx, None, "rl_loop_stable_reinforce")[0]  # the recipe's default loss


def part_rl_loop_gspo(ctx: Ctx) -> str:
    return rl_loop(ctx, "gspo", "rl_loop_gspo")[0]


def math_rl(ctx: Ctx, name: str, steps: int = MATH_RL_STEPS, **overrides: Any) -> str:
    from tinker_cookbook.recipes.math_rl import train as recipe
    log_path = ctx.work / name
    cli = recipe.CLIConfig(model_name=MODEL, base_url=ctx.base_url, log_path=str(log_path),
                           groups_per_batch=2, max_steps=steps,
                           behavior_if_log_dir_exists="raise", **overrides)
    loss = cli.loss_fn
    assert loss == "stable_reinforce", loss  # the recipe's default
    asyncio.run(recipe.cli_main(cli))
    rows = [r for r in metrics_rows(log_path) if RL_TRAIN_ROW in r]
    assert len(rows) == steps, f"{len(rows)} logged training steps, expected {steps}"
    trained = ctx.losses().get(loss, 0)
    assert trained >= steps, f"{trained} forward_backward with {loss}, expected {steps}"
    correct = ", ".join(f"{r.get('env/all/correct', float('nan')):.2f}" for r in rows)
    return (f"loss {loss}, env {cli.env}: {steps} steps, {trained} fwd/bwd requests, "
            f"fraction correct per step {correct}")


def part_math_rl_sync(ctx: Ctx) -> str:
    return math_rl(ctx, "math_rl_sync")


def part_math_rl_async(ctx: Ctx) -> str:
    return math_rl(ctx, "math_rl_async", max_steps_off_policy=1)


def part_math_rl_gsm8k(ctx: Ctx) -> str:
    return math_rl(ctx, "math_rl_gsm8k", env="gsm8k", max_tokens=16, group_size=8,
                   load_checkpoint_path=warm_start(ctx))


def check_adapter_dir(out: Path) -> str:
    from safetensors import safe_open
    files = sorted(p.name for p in out.iterdir())
    assert (out / "adapter_config.json").is_file(), f"no adapter_config.json in {files}"
    config = json.loads((out / "adapter_config.json").read_text())
    assert config.get("peft_type") == "LORA", config
    weights = out / "adapter_model.safetensors"
    assert weights.is_file(), f"no adapter_model.safetensors in {files}"
    with safe_open(str(weights), "pt") as f:
        keys = list(f.keys())
    assert any("lora_A" in k for k in keys) and any("lora_B" in k for k in keys), keys[:6]
    return f"{len(keys)} tensors, r={config.get('r')}"


# Run by the project's venv (peft, transformers): the downloaded adapter on the base model,
# logprobs of the target tokens, as the server computes them for `forward(cross_entropy)`.
PEFT_LOGPROBS = """
import json, sys
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
base_dir, adapter_dir, tokens, targets = sys.argv[1], sys.argv[2], *map(json.loads, sys.argv[3:])
base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
model = PeftModel.from_pretrained(base, adapter_dir).eval()
with torch.no_grad():
    logits = model(torch.tensor([tokens])).logits[0].float()
lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[:, None])[:, 0]
print(json.dumps(lp.tolist()))
"""


def peft_matches_server(ctx: Ctx, tc: Any, adapter_dir: Path, base_dir: str = "") -> float:
    """Max |logprob difference| between the server and PEFT loading `adapter_dir` on
    `base_dir` (default: the tiny model's own directory)."""
    from tinker_cookbook.supervised.data import conversation_to_datum
    renderer, _ = renderer_and_tokenizer()
    datum = conversation_to_datum(CONVERSATIONS[2], renderer, max_length=256)
    server = tc.forward([datum], loss_fn="cross_entropy").result()
    server_lp = server.loss_fn_outputs[0]["logprobs"].to_torch().tolist()
    tokens = datum.model_input.to_ints()
    targets = datum.loss_fn_inputs["target_tokens"].to_torch().tolist()
    base_dir = base_dir or (ctx.work / "tokenizer_id.txt").read_text()
    out = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), "-c", PEFT_LOGPROBS, base_dir,
         str(adapter_dir), json.dumps(tokens), json.dumps(targets)],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"PEFT could not load {adapter_dir}: {out.stderr[-1500:]}"
    peft_lp = json.loads(out.stdout.strip().splitlines()[-1])
    diff = max(abs(a - b) for a, b in zip(server_lp, peft_lp, strict=True))
    assert diff < 1e-3, f"PEFT logprobs differ from the server's by {diff:.2e}"
    return diff


def part_weights_download(ctx: Ctx) -> str:
    import tinker
    from tinker_cookbook import weights
    service = tinker.ServiceClient(base_url=ctx.base_url)
    tc = service.create_training_client_from_state(warm_start(ctx)).result()
    external = tc.save_weights_external("cookbook-check").result().path
    assert "/external_weights/" in external, external
    out = Path(weights.download(tinker_path=external, output_dir=str(ctx.work / "external"),
                                base_url=ctx.base_url))
    got_external = check_adapter_dir(out)
    diff = peft_matches_server(ctx, tc, out)
    # A training checkpoint: the cookbook exports it encrypted to a fresh age key, downloads,
    # decrypts and deletes the export.
    state = tc.save_state("cookbook-check-download").result().path
    out2 = Path(weights.download(tinker_path=state, output_dir=str(ctx.work / "from_state"),
                                 base_url=ctx.base_url))
    got_state = check_adapter_dir(out2)
    return (f"external_weights: {got_external}, PEFT logprobs = server's (max diff "
            f"{diff:.1e}); weights via an age-encrypted export: {got_state}")


# Renderer name -> a reply in that family's format, ending in its stop token.
RENDERER_REPLIES = {
    "qwen3": "<think>\nThe sum is 4.\n</think>\n\n4<|im_end|>",
    "qwen3_disable_thinking": "4<|im_end|>",
    "qwen3_instruct": "4<|im_end|>",
    "qwen3_5": "The sum is 4.\n</think>\n\n4<|im_end|>",
    "qwen3_5_disable_thinking": "4<|im_end|>",
    "llama3": "4<|eot_id|>",
    "gpt_oss_no_sysprompt": "<|channel|>final<|message|>4<|return|>",
    "gpt_oss_medium_reasoning": "<|channel|>analysis<|message|>The sum is 4.<|end|>"
                                "<|start|>assistant<|channel|>final<|message|>4<|return|>",
}


def part_renderers(ctx: Ctx) -> str:
    """Each renderer, as a recipe uses it, on the tiny model's tokenizer (no server call)."""
    from tinker_cookbook import renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer
    tokenizer = get_tokenizer(MODEL)
    convo = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": "What is 2 + 2?"},
             {"role": "assistant", "content": "4"}]
    done = []
    for name, reply in RENDERER_REPLIES.items():
        renderer = renderers.get_renderer(name, tokenizer)
        prompt = renderer.build_generation_prompt(convo[:2]).to_ints()
        model_input, weights = renderer.build_supervised_example(convo)
        assert model_input.length == len(weights) and float(weights.sum()) > 0, name
        stops = renderer.get_stop_sequences()
        # The stop tokens are single ids (gpt-oss asserts it for <|return|> and <|call|>).
        assert stops and all(isinstance(t, int) for t in stops), (name, stops)
        message, _ = renderer.parse_response(tokenizer.encode(reply, add_special_tokens=False))
        text = renderers.get_text_content(message)
        assert text.strip() == "4", (name, message)
        done.append(f"{name} ({len(prompt)} prompt tokens)")
    return "parsed a reply with each of " + ", ".join(done)


def part_dpo(ctx: Ctx) -> str:
    from tinker_cookbook.recipes.preference.dpo import train as recipe
    log_path = ctx.work / "dpo"
    cli = recipe.CLIConfig(model_name=MODEL, dataset="hhh", base_url=ctx.base_url,
                           log_path=str(log_path), batch_size=2, max_length=512,
                           learning_rate=1e-4, max_steps=2, behavior_if_log_dir_exists="raise")
    recipe.cli_main(cli)
    rows = [r for r in metrics_rows(log_path) if "dpo_loss" in r]
    assert len(rows) == 2, f"{len(rows)} logged DPO steps, expected 2"
    assert all(math.isfinite(r["dpo_loss"]) for r in rows), rows
    # Reference logprobs come from a sampling client of the initial weights, kept by the
    # server for the whole session (train_dpo's reference_model_name=None).
    return (f"2 steps of 2 pairs, dpo_loss {rows[0]['dpo_loss']:.4f} -> "
            f"{rows[-1]['dpo_loss']:.4f}, accuracy {rows[-1]['accuracy']:.2f}")


def part_decisions_forecasting(ctx: Ctx) -> str:
    from tinker_cookbook.recipes.decisions import forecasting as recipe
    log_path = ctx.work / "decisions_forecasting"
    cfg = recipe.Config(model_name=MODEL, base_url=ctx.base_url, log_path=str(log_path),
                        data_path=str(DATA / "prophet-arena.csv"), lora_rank=8,
                        batch_size=2, max_steps=2, behavior_if_log_dir_exists="raise")
    asyncio.run(recipe.main(cfg))
    rows = metrics_rows(log_path)
    train = [r for r in rows if "train/loss" in r]
    test = [r for r in rows if "test/brier_reward" in r]
    assert [r["step"] for r in train] == [1, 2], rows
    assert len(test) == 2 and all(math.isfinite(r["test/brier_reward"]) for r in test), rows
    return (f"2 steps, Brier loss {train[0]['train/loss']:.4f} -> {train[-1]['train/loss']:.4f}, "
            f"validation Brier reward {test[0]['test/brier_reward']:.4f} -> "
            f"{test[-1]['test/brier_reward']:.4f}")


# rubric's grader asks for 2048 tokens a grade; the untrained tiny grader never writes its
# stop token, and 2048 decode steps cost minutes on 2 CPU cores. The check caps the reply.
GRADER_MAX_TOKENS = 48


def part_rubric(ctx: Ctx) -> str:
    from tinker_cookbook.completers import TinkerMessageCompleter
    from tinker_cookbook.recipes.rubric import env as rubric_env
    from tinker_cookbook.recipes.rubric import train as recipe

    def capped_grader(*, sampling_client, renderer, max_tokens, **kwargs):
        return TinkerMessageCompleter(sampling_client=sampling_client, renderer=renderer,
                                      max_tokens=min(max_tokens, GRADER_MAX_TOKENS), **kwargs)

    rubric_env.TinkerMessageCompleter = capped_grader  # imported by name there
    log_path = ctx.work / "rubric"
    cli = recipe.CLIConfig(model_name=MODEL, base_url=ctx.base_url,
                           log_path=str(log_path), lora_rank=8, groups_per_batch=1,
                           train_group_size=2, max_tokens=16, max_steps=2, eval_every=0,
                           save_every=0, train_jsonl_path=str(DATA / "rubric-train.jsonl"),
                           test_jsonl_path=str(DATA / "rubric-test.jsonl"),
                           behavior_if_log_dir_exists="raise")
    assert cli.renderer_name == cli.grader_renderer_name == "qwen3_5_disable_thinking"
    assert cli.grader_llm_name == GRADER, cli.grader_llm_name   # the recipe's own default
    asyncio.run(recipe.cli_main(cli))
    rows = [r for r in metrics_rows(log_path) if RL_TRAIN_ROW in r]
    assert len(rows) == 2, f"{len(rows)} logged training steps, expected 2"
    return (f"2 steps, renderer {cli.renderer_name}, grader {GRADER} (tiny-large), "
            f"fwd/bwd {ctx.losses()}, "
            f"reward per step {', '.join(f'{r[RL_TRAIN_ROW]:.2f}' for r in rows)}")


def part_distillation(ctx: Ctx) -> str:
    from tinker_cookbook.recipes.distillation import on_policy_distillation as recipe
    log_path = ctx.work / "distillation"
    # Its defaults (student Qwen3.5-9B-Base, teacher Qwen3.5-9B, dataset deepmath, loss
    # importance_sampling, KL penalty 1) but the size of a check.
    cli = recipe.CLIConfig(base_url=ctx.base_url, log_path=str(log_path), lora_rank=8,
                           group_size=2, groups_per_batch=2, max_tokens=16, max_steps=2,
                           behavior_if_log_dir_exists="raise")
    assert (cli.model_name, cli.teacher_model) == (STUDENT_NAMES[1], TEACHER)
    asyncio.run(recipe.cli_main(cli))
    rows = [r for r in metrics_rows(log_path) if DISTILL_ROW in r]
    assert len(rows) == 2, f"{len(rows)} logged training steps, expected 2"
    kl = [r[DISTILL_ROW] for r in rows]
    assert all(math.isfinite(k) for k in kl), kl
    # The teacher's logprobs came from its own engine (the server logs each op's base;
    # the SDK's compute_logprobs is a sample request with prompt logprobs).
    server_log = (ctx.work.parent / "server.log").read_text()
    assert re.search(rf"op=prompt_logprobs .* base={re.escape(TEACHER)}$", server_log,
                     re.M), "no prompt logprobs ran on the teacher's base"
    return (f"2 steps of 2 prompts x 2, student {cli.model_name} (tiny), teacher "
            f"{cli.teacher_model} (tiny-large), fwd/bwd {ctx.losses()}, "
            f"teacher KL per step {', '.join(f'{k:.2f}' for k in kl)}")


def part_sdft(ctx: Ctx) -> str:
    from tinker_cookbook.recipes.sdft import train as recipe
    log_path = ctx.work / "sdft"
    # Its defaults (Qwen3-8B, sciknoweval Chemistry, top-20 distillation from the model
    # conditioned on the answer) but the size of a check.
    cli = recipe.CLIConfig(base_url=ctx.base_url, log_path=str(log_path), lora_rank=8,
                           groups_per_batch=2, max_tokens=16, max_steps=2, eval_every=0,
                           save_every=0, behavior_if_log_dir_exists="raise")
    assert (cli.model_name, cli.dataset, cli.topk) == (STUDENT_NAMES[2], "sciknoweval", 20)
    asyncio.run(recipe.cli_main(cli))
    rows = [r for r in metrics_rows(log_path) if "sdft/num_datums" in r]
    assert len(rows) == 2, f"{len(rows)} logged training steps, expected 2"
    # Each step distilled both questions' completions from the top-20 prompt logprobs.
    assert all(r["sdft/num_datums"] == 2 and r["sdft/topk"] == cli.topk
               and math.isfinite(r["sdft/mean_teacher_entropy"]) for r in rows), rows
    entropy = ", ".join(f"{r['sdft/mean_teacher_entropy']:.2f}" for r in rows)
    return (f"2 steps of 2 questions, top-{cli.topk} teacher logprobs, fwd/bwd "
            f"{ctx.losses()}, teacher entropy per step {entropy}")


def part_guess_number(ctx: Ctx) -> str:
    from tinker_cookbook.recipes.multiplayer_rl.guess_number import train as recipe
    from tinker_cookbook.rl import train
    log_path = ctx.work / "guess_number"
    # Each game is up to 10 turns (the env's MAX_TURNS), one sample request each.
    cli = recipe.CLIConfig(model_name=MODEL, log_path=str(log_path), batch_size=1,
                           group_size=2, max_tokens=8, eval_every=0, save_every=0,
                           max_steps=2, behavior_if_log_dir_exists="raise")
    assert cli.renderer_name == "qwen3_5_disable_thinking", cli.renderer_name
    config = recipe.build_config(cli)
    asyncio.run(train.main(config))  # as the recipe's __main__
    rows = [r for r in metrics_rows(log_path) if RL_TRAIN_ROW in r]
    assert len(rows) == 2, f"{len(rows)} logged training steps, expected 2"
    return (f"2 steps of 1 group x 2 games, renderer {cli.renderer_name}, fwd/bwd {ctx.losses()}, "
            f"reward per step {', '.join(f'{r[RL_TRAIN_ROW]:.2f}' for r in rows)}")


def part_step_column(ctx: Ctx) -> str:
    summary, log_path = rl_loop(ctx, "importance_sampling", "step_column")
    steps = check_steps(log_path, RL_LOOP_ROW, RL_LOOP_STEPS)
    checked = [f"rl_loop {steps}"]
    # And every recipe run earlier in this invocation.
    earlier = {"rl_loop_is": (RL_LOOP_ROW, RL_LOOP_STEPS),
               "rl_loop_stable_reinforce": (RL_LOOP_ROW, RL_LOOP_STEPS),
               "rl_loop_gspo": (RL_LOOP_ROW, RL_LOOP_STEPS),
               "math_rl_sync": (RL_TRAIN_ROW, MATH_RL_STEPS),
               "math_rl_async": (RL_TRAIN_ROW, MATH_RL_STEPS),
               "math_rl_gsm8k": (RL_TRAIN_ROW, MATH_RL_STEPS),
               "dpo": ("dpo_loss", 2),
               "rubric": (RL_TRAIN_ROW, 2),
               "guess_number": (RL_TRAIN_ROW, 2)}
    for name, (row_key, n) in earlier.items():
        if (ctx.work / name / "metrics.jsonl").exists():
            check_steps(ctx.work / name, row_key, n)
            checked.append(name)
    return "integer steps 0, 1, ... in " + ", ".join(checked)


def sl_loop_family(ctx: Ctx, model: str) -> str:
    """sl_loop on `model`'s tiny family model; its final weights sample (the trainer scores
    the sampled tokens alike) and export to PEFT with the server's logprobs."""
    import tinker
    from tinker_cookbook import model_info, renderers, weights
    from tinker_cookbook.recipes import sl_loop as recipe
    from tinker_cookbook.tokenizer_utils import get_tokenizer
    family = FAMILY_OF[model]
    log_path = ctx.work / f"sl_loop-{family}"
    recipe.main(recipe.Config(base_url=ctx.base_url, log_path=str(log_path), model_name=model,
                              batch_size=2, learning_rate=5e-3, max_steps=3, lora_rank=8,
                              save_every=0, max_length=512))
    nlls = [r["train_mean_nll"] for r in metrics_rows(log_path) if "train_mean_nll" in r]
    assert len(nlls) == 3 and all(math.isfinite(x) for x in nlls), nlls
    assert ctx.losses() == {"cross_entropy": 3}, ctx.losses()
    record = json.loads((log_path / "checkpoints.jsonl").read_text().splitlines()[-1])

    service = tinker.ServiceClient(base_url=ctx.base_url)
    tc = service.create_training_client_from_state(record["state_path"]).result()
    sampler = service.create_sampling_client(model_path=record["sampler_path"])
    renderer = renderers.get_renderer(model_info.get_recommended_renderer_name(model),
                                      get_tokenizer(model))
    prompt = renderer.build_generation_prompt(
        [{"role": "user", "content": "Name a fruit that is yellow."}])
    seq = sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=8, seed=0)
                         ).result().sequences[0]
    full = prompt.to_ints() + list(seq.tokens)
    datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(full[:-1]),
                         loss_fn_inputs={"target_tokens": full[1:],
                                         "weights": [1.0] * (len(full) - 1)})
    scored = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    trained = scored.to_torch().tolist()[-len(seq.tokens):]
    gap = max(abs(a - b) for a, b in zip(seq.logprobs, trained, strict=True))
    assert gap < 1e-3, f"the sampler's logprobs differ from the trainer's by {gap:.2e}"

    external = tc.save_weights_external(f"cookbook-check-{family}").result().path
    out = Path(weights.download(tinker_path=external, output_dir=str(ctx.work / family),
                                base_url=ctx.base_url))
    diff = peft_matches_server(ctx, tc, out, ctx.family_models[model])
    return (f"{family}: 3 steps, NLL {', '.join(f'{x:.3f}' for x in nlls)}; sampled "
            f"{len(seq.tokens)} tokens, sampler = trainer (max diff {gap:.1e}); "
            f"{check_adapter_dir(out)}, PEFT = server (max diff {diff:.1e})")


def part_sl_loop_moe(ctx: Ctx) -> str:
    return sl_loop_family(ctx, MOE_MODEL)


def part_sl_loop_hybrid(ctx: Ctx) -> str:
    return sl_loop_family(ctx, HYBRID_MODEL)


def child(name: str, base_url: str, work: Path) -> int:
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ["TINKER_API_KEY"] = API_KEY
    # Where a recipe builds a ServiceClient without passing its base_url (guess_number's
    # train.Config, rubric's grader), the SDK reads this.
    os.environ["TINKER_BASE_URL"] = base_url
    os.environ["HF_DATASETS_CACHE"] = str(work / "hf-datasets")  # the local rows' arrow cache
    ctx = Ctx(base_url, work)
    result_file = work / f"part-{name}.json"
    try:
        local_inputs(ctx)
        install_spy(ctx)
        summary = globals()[f"part_{name}"](ctx)
        result = {"ok": True, "summary": summary}
    except BaseException as e:  # noqa: BLE001 - reported, not swallowed
        traceback.print_exc()
        msg = f"{type(e).__name__}: {e}".replace("\n", " ")
        result = {"ok": False, "summary": msg[:600]}
    sys.stdout.flush()
    result_file.write_text(json.dumps(result))
    os._exit(0 if result["ok"] else 1)  # the SDK's threads must not keep a failed part alive


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[],
                        help="comma-separated parts to run (repeatable); default all")
    parser.add_argument("--list", action="store_true", help="list the parts and exit")
    parser.add_argument("--keep", action="store_true", help="keep the data and log dir")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.list:
        for name, (limit, what) in PARTS.items():
            print(f"{name:26s} (<= {limit}s) {what}")
        return 0
    if args.child:
        return child(args.child, args.base_url, Path(args.work))
    only = [p.strip() for chunk in args.only for p in chunk.split(",") if p.strip()]
    return parent(only, args.keep)


if __name__ == "__main__":
    sys.exit(main())
