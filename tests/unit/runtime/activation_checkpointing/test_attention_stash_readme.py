# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""README.md's "Quick start" and "With the Hugging Face Trainer or TRL" code blocks, read from the README and run as
written: each block is exec'd unmodified, in a fresh namespace, prefilled only with what its comment says the user
brings (a model, a data set, a DeepSpeed config, a tokenizer).

The blocks assert handle.recomputes_served themselves; each test also counts the attention forward kernels the block
ran (CountOps): a served recompute runs none, so a stash that silently stood aside, running the attention forward
twice per step, fails here even where a counter said otherwise.
"""

import os
import re

import pytest
import torch

from attention_stash_helpers import CPU_FORWARD, CountOps, assert_stock_process, batch_ids, free_port, llama_model

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), *[os.pardir] * 4, "README.md")
QUICK_START = "Quick start"
TRAINERS = "With the Hugging Face Trainer or TRL"
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# What the Trainer blocks stash and train: the last 4 attention layers, 2 steps of 2 rows of 32 tokens.
STASHED = 4
STEPS = 2
ROWS = 4
SEQUENCE = 32
# The helpers' tiny Llama's vocabulary.
VOCAB_SIZE = 128
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")


def readme_blocks(heading):
    """The ```python blocks of README.md's ``## heading`` section (up to the next ``## `` heading outside a code
    block), in order, each as its source text."""
    with open(README, encoding="utf-8") as readme:
        lines = readme.read().splitlines()
    assert f"## {heading}" in lines, f"README.md has no '## {heading}' heading"
    blocks, fence, block = [], None, None
    for line in lines[lines.index(f"## {heading}") + 1:]:
        if fence is None and line.startswith("## "):
            break
        if fence is None and line.startswith("```"):
            fence = line
            block = [] if line == "```python" else None
        elif fence is not None and line == "```":
            if block is not None:
                blocks.append("\n".join(block) + "\n")
            fence = block = None
        elif block is not None:
            block.append(line)
    assert fence is None, f"README.md's '## {heading}' section ends inside a {fence} block"
    assert blocks, f"README.md's '## {heading}' section has no ```python block"
    return blocks


def run_block(source, name, namespace):
    """Runs ``source`` as written in ``namespace``, as README.md's ``name``; returns the aten calls it made."""
    with CountOps() as counted:
        exec(compile(source, f"README.md {name}", "exec"), namespace)
    return counted.calls


@pytest.fixture
def namespace():
    """The namespace a block runs in; after the test, the handle the block left in it removed, and nothing of the stash
    left in the process."""
    names = {}
    yield names
    handle = names.get("handle")
    if handle is not None:
        handle.remove()
    assert_stock_process()


@pytest.fixture
def launcher_process(monkeypatch, tmp_path):
    """A run as the launcher starts one, in ``tmp_path`` (the blocks' output_dir "out" lands there): DeepSpeed's
    process-group variables, set as test_attention_stash_deepspeed.py sets them, where they are not set already. After
    the test, the process as it was: the process group the Trainer's DeepSpeed engine made destroyed (one that was
    there before is kept), accelerate's state, the Trainer's DeepSpeed config, and the variables the Trainer set
    (ACCELERATE_USE_DEEPSPEED).

    The engine made it when DeepSpeed's TorchBackend, setting up, found no process group (its is_initialized() is
    torch's). deepspeed.comm.is_initialized() is False until DeepSpeed has a backend, even where torch has a process
    group, as accelerate makes for a Trainer run without DeepSpeed under the launcher's variables: the engine adopts
    that one, and it is kept."""
    import deepspeed.comm
    from accelerate.state import AcceleratorState
    from deepspeed.comm.torch import TorchBackend
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    environment, threads = dict(os.environ), torch.get_num_threads()
    made_process_group = []
    set_up = TorchBackend.init_process_group

    def recording_set_up(backend, *args, **kwargs):
        made_process_group.append(not backend.is_initialized())
        return set_up(backend, *args, **kwargs)

    monkeypatch.setattr(TorchBackend, "init_process_group", recording_set_up)
    for name, default in zip(LAUNCHER_VARIABLES, ("0", "0", "1", "127.0.0.1", free_port())):
        if name not in os.environ:
            monkeypatch.setenv(name, default)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()
    if any(made_process_group) and deepspeed.comm.is_initialized():
        # DeepSpeed's own destroy also drops the groups DeepSpeed cached from this process group.
        deepspeed.comm.destroy_process_group()
    for name in set(os.environ) - set(environment):
        del os.environ[name]
    os.environ.update(environment)
    # accelerate sets the number of threads on a CPU run without OMP_NUM_THREADS (use_cpu=True).
    torch.set_num_threads(threads)


def tiny_llama():
    """The helpers' tiny Llama (vocabulary 128, hidden 64, sdpa) with 4 layers, as the blocks stash."""
    return llama_model(num_hidden_layers=STASHED)


def deepspeed_config():
    """A DeepSpeed config for one CPU process: the Trainer fills the "auto" entries; PyTorch's AdamW, not DeepSpeed's
    CPU Adam (a C++ op)."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": "auto",
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": 0
        },
    }


def word_level_tokenizer(vocab_size):
    """A tokenizer built offline (the Hub is not reached): one word per token id, with pad and eos tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [*SPECIAL_TOKENS, *(f"w{index}" for index in range(len(SPECIAL_TOKENS), vocab_size))]
    tokenizer = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def token_rows():
    """ROWS rows of SEQUENCE token ids, none of them a special token."""
    return [
        (batch_ids(seed=row, batch=1, sequence=SEQUENCE)[0] % (VOCAB_SIZE - len(SPECIAL_TOKENS)) + len(SPECIAL_TOKENS))
        for row in range(ROWS)
    ]


def assert_trained_and_served(namespace, calls, launcher_process):
    model, handle = namespace["model"], namespace["handle"]
    # The Trainer turned checkpointing on, after the install, on every layer.
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    assert handle.layers == tuple(f"model.layers.{index}" for index in range(STASHED))
    assert (handle.recomputes_served, handle.num_kept, handle.kept_bytes) == (STEPS * STASHED, 0, 0)
    # Without the stash each layer runs the attention forward twice per step (its first pass and its recompute),
    # with it once.
    assert calls[CPU_FORWARD] == STEPS * STASHED
    assert (launcher_process / "out").is_dir()


def test_quick_start(namespace, capsys):
    block, = readme_blocks(QUICK_START)
    assert len(block.splitlines()) <= 15, block
    calls = run_block(block, QUICK_START, namespace)
    handle = namespace["handle"]
    assert (handle.recomputes_served, handle.num_kept, handle.kept_bytes) == (4, 0, 0)
    # One attention forward per layer, in the first pass: the 4 recomputes took the kept outputs instead.
    assert calls[CPU_FORWARD] == 4
    assert capsys.readouterr().out == f"{handle!r}\n"
    assert repr(handle).startswith("AttentionStashHandle(4 layers, 0 kept, 4 served: ")


def test_hugging_face_trainer(namespace, launcher_process):
    trainer_block = readme_blocks(TRAINERS)[0]
    assert "Trainer(" in trainer_block and "SFTTrainer" not in trainer_block, trainer_block
    rows = [{"input_ids": ids, "labels": ids} for ids in token_rows()]
    namespace.update(model=tiny_llama(), train_dataset=rows, ds_config=deepspeed_config())
    calls = run_block(trainer_block, "Trainer", namespace)
    assert_trained_and_served(namespace, calls, launcher_process)


def test_trl_sft_trainer(namespace, launcher_process):
    pytest.importorskip("trl", reason="the README's TRL block needs trl (requirements/requirements-dev.txt)")
    import datasets

    sft_block = readme_blocks(TRAINERS)[1]
    assert "SFTTrainer(" in sft_block, sft_block
    # Pre-tokenized rows: SFTTrainer takes an "input_ids" column as it is, and its collator pads and makes the labels.
    rows = datasets.Dataset.from_dict({"input_ids": [ids.tolist() for ids in token_rows()]})
    namespace.update(model=tiny_llama(),
                     train_dataset=rows,
                     ds_config=deepspeed_config(),
                     tokenizer=word_level_tokenizer(VOCAB_SIZE))
    calls = run_block(sft_block, "TRL", namespace)
    assert_trained_and_served(namespace, calls, launcher_process)


# The README's order (issue 45): what it does, the measured gain, what is served, then install, the recipes and the
# limitations, and the two set-up commands last.
README_SECTIONS = ("Measured gain", "What is served", "Install", QUICK_START, TRAINERS, "Limitations",
                   "Benchmark and tests")


def test_the_readme_reads_as_the_users_page():
    """At most 1,200 words outside code, no paragraph over 120 words, its sections in the user's order, the measured
    gain in the first 40 lines and the support table in the first 80."""
    with open(README, encoding="utf-8") as readme:
        text = readme.read()
    prose = re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)
    assert len(prose.split()) <= 1200
    paragraphs = [paragraph for paragraph in prose.split("\n\n") if paragraph.strip()]
    assert max(len(paragraph.split()) for paragraph in paragraphs) <= 120
    lines = text.splitlines()
    headings = [line[3:] for line in lines if line.startswith("## ")]
    assert headings == list(README_SECTIONS)
    assert lines.index("## Measured gain") < 40 and lines.index("## What is served") < 80
    assert next(index for index, line in enumerate(lines) if line.startswith("| `attn_implementation`")) < 80


def test_the_test_command_installs_flash_attn_outside_site_packages(pytestconfig):
    """The README's test command builds flash-attn's Python layer into .test-packages (never site-packages), skips it
    where a flash-attn is installed, and the test session finds that folder (tests/conftest.py)."""
    with open(README, encoding="utf-8") as readme:
        lines = readme.read().splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith("Install and run the unit tests"))
    command = lines[lines.index("```bash", start) + 1]
    flash_installs = re.findall(r"pip install [^&|]*flash-attn==[\d.]+", command)
    assert flash_installs and all("--target .test-packages " in install for install in flash_installs), command
    assert "pip show -q flash-attn" in command
    # tests/conftest.py, as pytest loaded it, names that folder.
    root = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    loaded = [
        plugin for plugin in pytestconfig.pluginmanager.get_plugins()
        if getattr(plugin, "__file__", None) == os.path.join(root, "tests", "conftest.py")
    ]
    assert [plugin.TEST_PACKAGES for plugin in loaded] == [os.path.join(root, ".test-packages")]
