"""The README's fine-tuning worked example runs as printed (issue 24, part 5), and its export stops.

Both code blocks are read from README.md: the bash block runs in a fresh directory with
``models/qwen3-0.6b`` pointing at a tiny local Qwen3 (Qwen3's own chat template, a base model's eos
``<|endoftext|>``, so the turn terminator ``<|im_end|>`` is not the eos) and ``train.steps=3`` appended
(Hydra's last value wins; the store in a private directory); then the Python block runs on the last
checkpoint. The checkpoint's ``generation_config.json`` must list ``<|im_end|>`` among the eos ids,
and transformers' ``generate`` must stop on it (issue 24, part 3).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import transformers
from chat_fixtures import qwen3_tokenizer, save
from conftest import job_env
from test_export import assert_stops_on

ROOT = Path(__file__).resolve().parents[2]
QWEN = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    tie_word_embeddings=True,
)


def _example_blocks() -> tuple[str, str]:
    section = (ROOT / "README.md").read_text().split("### Fine-tuning on chat or instruction data", 1)[1]
    section = section.split("\n## ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", section, re.S)[1]
    python = re.search(r"```python\n(.*?)```", section, re.S)[1]
    return bash, python


def test_the_readme_fine_tuning_example_runs_as_printed_and_its_export_stops(tmp_path: Path) -> None:
    model_dir = tmp_path / "models" / "qwen3-0.6b"
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN)).save_pretrained(model_dir)
    save(qwen3_tokenizer("<|endoftext|>"), model_dir)
    bash, python = _example_blocks()
    assert "optim.min_lr" in bash and "models/qwen3-0.6b" in bash
    command = bash.rstrip() + f" \\\n    train.steps=3 store.dir={tmp_path}\n"
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # torchrun
    env = job_env(NODETRAIN_RUNS=str(tmp_path / "runs"), PATH=path)
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", command],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    (step,) = (tmp_path / "runs").glob("*/checkpoints/step-3")

    tok = transformers.AutoTokenizer.from_pretrained(step)
    im_end, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    generation = json.loads((step / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [eos, im_end]
    assert_stops_on(step, [eos, im_end])

    snippet = python.replace('"runs/<run>/checkpoints/step-100"', repr(str(step)))
    assert snippet != python
    proc = subprocess.run(
        [sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
