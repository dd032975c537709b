"""A Hugging Face checkpoint folder as a part's snapshot: `import_checkpoint` (`ipnext snapshot
import-hf`) writes its manifest, validation pins every file and builds the LLM part from the
pinned bytes, and the part's tokenizer and chat template answer as transformers' do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from ipnext.errors import CheckpointError, SnapshotError
from ipnext.serving.llm.chat import ChatTemplate
from ipnext.serving.llm.engine import SamplingParams
from ipnext.serving.llm.part import LLMPart
from ipnext.spec.model import ModelSpec, checkpoint_digest
from ipnext.store.pinned import CheckpointFiles, load_verified_checkpoint, pinned_path, verify_ref
from ipnext.store.snapshots import import_checkpoint, read_manifest, request_from_folder
from ipnext.store.validation import validate_snapshot
from tests.llm.hf_checkpoints import NEW_TOKENS, write_checkpoint

ENGINE = {"kv_cache_bytes": 1 << 22, "block_size": 4, "max_num_seqs": 4, "backend": "torch"}


def llm_spec(name: str) -> ModelSpec:
    return ModelSpec.model_validate(
        {
            "name": name,
            "owner": "llm-team",
            "parts": {
                "lm": {
                    "factory": "ipnext.serving.llm.part:LLMPart",
                    "hardware": {"cpu-std": {"units": 2, "qps": 20}},
                    "config": {"engine": ENGINE},
                }
            },
            "dag": [["input", "lm"], ["lm", "output"]],
            "traffic": {"peak_qps": {"us-east": 10}},
            "latency_budget_ms": 50,
        }
    )


@pytest.fixture
def snapshot(tmp_path: Path) -> tuple[Path, Path]:
    """A Qwen2 checkpoint saved straight into <root>/chat-lm/v1/, as a download job would."""
    root = tmp_path / "snapshots"
    folder = write_checkpoint(root / "chat-lm" / "v1", "qwen2")
    (folder / "pytorch_model.bin").write_bytes(b"not read, ever")  # left out of the manifest
    return root, folder


def test_import_validate_and_serve_a_checkpoint_from_its_pinned_files(
    snapshot: tuple[Path, Path], tmp_path: Path
) -> None:
    root, folder = snapshot
    lines: list[str] = []
    where, manifest, left_out = import_checkpoint(folder, "chat-lm", "lm", "v1", log=lines.append)
    assert where == folder and left_out == ["pytorch_model.bin"]
    entry = manifest.parts["lm"]
    assert entry.checkpoint == "." and entry.files is not None
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(entry.files)
    assert entry.sha256 == checkpoint_digest(entry.files) and len(lines) == len(entry.files)
    assert read_manifest(folder) == manifest

    ref = request_from_folder(folder).parts["lm"]
    store = tmp_path / "pinned"
    validate_snapshot(llm_spec("chat-lm"), "lm", ref, [root], store)  # pins, then builds the part
    assert verify_ref(store, ref) is None
    files = load_verified_checkpoint(pinned_path(store, ref.sha256, ".json"), ref.sha256)
    assert isinstance(files, CheckpointFiles) and set(files) == set(entry.files)

    # The part built from the pinned bytes: its tokenizer and chat template are transformers'.
    part = LLMPart(files, {"engine": ENGINE})
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    text = "hello world, how are you today?"
    assert part.codec.prompt(text) == reference(text).input_ids
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the quick brown fox"},
        {"role": "assistant", "content": "jumps"},
        {"role": "user", "content": "ünïcödé?"},
    ]
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert part.codec.chat_prompt(messages) == expected
    # ... and its greedy tokens are transformers' generate on the same weights.
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([expected]),
        attention_mask=torch.ones(1, len(expected), dtype=torch.long),  # <s> is id 0, as is the pad
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(expected) :].tolist()
    seq = part.engine.add(expected, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    while part.engine.has_work():
        part.engine.step()
    assert seq.output == out
    assert part.codec.eos_ids == (reference.convert_tokens_to_ids("</s>"),)

    # The training job's folder may change now: the pinned copy is what serves.
    shutil.rmtree(folder)
    assert verify_ref(store, ref) is None


def test_a_file_changed_after_import_fails_validation_naming_it(
    snapshot: tuple[Path, Path], tmp_path: Path
) -> None:
    root, folder = snapshot
    import_checkpoint(folder, "chat-lm", "lm", "v1")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<s>"}))
    ref = request_from_folder(folder).parts["lm"]
    with pytest.raises(SnapshotError, match=r"tokenizer_config\.json: checksum mismatch") as refused:
        validate_snapshot(llm_spec("chat-lm"), "lm", ref, [root], tmp_path / "pinned")
    assert refused.value.field == "parts.lm.files.tokenizer_config.json"


def test_a_checkpoint_outside_its_snapshot_folder_or_without_safetensors_is_refused(tmp_path: Path) -> None:
    loose = write_checkpoint(tmp_path / "downloads" / "qwen", "qwen2")
    with pytest.raises(SnapshotError, match=r"move the folder to <snapshot root>/chat-lm/v1/"):
        import_checkpoint(loose, "chat-lm", "lm", "v1")
    pickled = tmp_path / "chat-lm" / "v2"
    shutil.copytree(loose, pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(SnapshotError, match=r"pickled weights are never read"):
        import_checkpoint(pickled, "chat-lm", "lm", "v2")


def test_a_second_part_beside_the_first_keeps_it_in_the_manifest(tmp_path: Path) -> None:
    version = tmp_path / "pair" / "v1"
    write_checkpoint(version / "prefill", "llama3")
    write_checkpoint(version / "decode", "llama3")
    import_checkpoint(version / "prefill", "pair", "prefill", "v1")
    _, manifest, _ = import_checkpoint(version / "decode", "pair", "decode", "v1")
    assert {p: e.checkpoint for p, e in manifest.parts.items()} == {"prefill": "prefill", "decode": "decode"}
    refs = request_from_folder(version).parts
    assert refs["decode"].uri == (version / "decode").as_uri()


ESCAPES = {
    "class-walk": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "item-walk": "{{ messages['__class__'] }}",
    "mro": "{{ cycler.mro }}",
}


@pytest.mark.parametrize("template", ESCAPES)
def test_a_chat_template_reaching_out_of_its_sandbox_is_refused_when_the_part_is_built(template: str) -> None:
    with pytest.raises(CheckpointError, match="sandbox"):
        ChatTemplate(ESCAPES[template], {"bos_token": "<s>"})


def test_a_template_that_cannot_render_a_user_message_is_refused() -> None:
    with pytest.raises(CheckpointError, match="cannot render one user message: TemplateError: no users"):
        ChatTemplate("{{ raise_exception('no users') }}", {})
    with pytest.raises(CheckpointError, match="does not parse"):
        ChatTemplate("{% for m in messages %}", {})


def test_generation_blocks_and_tojson_render_as_transformers_renders_them() -> None:
    template = ChatTemplate(
        "{% for m in messages %}{% generation %}{{ m.content | tojson }}{% endgeneration %}{% endfor %}", {}
    )
    assert template.render([{"role": "user", "content": "ünï"}]) == '"ünï"'
