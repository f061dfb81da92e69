"""Model folders never run code: a folder whose config or tokenizer asks for Python code of its
own (`auto_map`) is a clear ValueError, and the code is not run; every transformers load in
shoal passes `trust_remote_code=False` (checked over the source, so a new call site cannot
forget it)."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

import shoal
from shoal.config import EngineArgs
from shoal.frontend.tokenizer import get_tokenizer

# Code that would leave a mark if anything imported it.
_EVIL = 'import pathlib\npathlib.Path(__file__).with_name("RAN").write_text("ran")\n'


def _plant(folder: Path, module: str) -> None:
    (folder / f"{module}.py").write_text(_EVIL)


def test_config_asking_for_remote_code_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "custom"
    folder.mkdir()
    config = {
        "model_type": "custom_arch",
        "architectures": ["CustomForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"},
    }
    (folder / "config.json").write_text(json.dumps(config))
    _plant(folder, "configuration_custom")
    with pytest.raises(ValueError, match="never runs code from a model folder"):
        EngineArgs(model=str(folder), device="cpu").create_engine_config()
    assert not (folder / "RAN").exists()


def test_tokenizer_asking_for_remote_code_is_refused(tiny_checkpoints: dict, tmp_path: Path) -> None:
    folder = tmp_path / "custom_tokenizer"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}
    tokenizer_config["tokenizer_class"] = "CustomTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    _plant(folder, "tokenization_custom")
    with pytest.raises(ValueError, match="never runs code from a model folder"):
        get_tokenizer(str(folder))
    assert not (folder / "RAN").exists()


_LOADERS = {"from_pretrained", "from_config"}


def test_every_transformers_load_passes_trust_remote_code_false() -> None:
    missing = []
    for path in sorted(Path(shoal.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _LOADERS:
                passed = {k.arg: k.value for k in node.keywords}
                value = passed.get("trust_remote_code")
                if not (isinstance(value, ast.Constant) and value.value is False):
                    missing.append(f"{path.name}:{node.lineno}")
    assert not missing, f"transformers loads without trust_remote_code=False: {missing}"
