"""`k3 export --format hf`: one checkpoint as a folder Hugging Face transformers loads with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` and `AutoTokenizer.from_pretrained(DIR)`.

OUT/ holds
  config.json             model_type k3, an `auto_map` to modeling_k3.py, the run's resolved config (`k3_config`)
  modeling_k3.py          K3Config and K3ForCausalLM, which build k3's own CausalLM (k3cli must be installed)
  model.safetensors       the weights under K3ForCausalLM's names (`k3.` + k3's own)
  tokenizer.json          the run's tokenizer, adding `<|endoftext|>` before every sequence as training did
  tokenizer_config.json, special_tokens_map.json, generation_config.json

Tensors are checked against the config's model before anything is written; the folder is built beside
OUT and renamed into place.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import safetensors.torch
import torch
import yaml

from k3cli.checkpoint.api import load_full_model_state
from k3cli.checkpoint.export import check_fits
from k3cli.checkpoint.folder import MARKER, MODEL_FILE
from k3cli.config import dump_config, load_config
from k3cli.data import EOT_ID, load_tokenizer
from k3cli.errors import CheckpointError
from k3cli.files import build_folder, is_free
from k3cli.models.causal_lm import CausalLM

MODELING = Path(__file__).with_name("modeling_k3.py")
PREFIX = "k3."   # K3ForCausalLM holds the CausalLM as `.k3`


def hf_config(cfg, bos_id: int = EOT_ID, eos_id: int = EOT_ID) -> dict:
    return {
        "architectures": ["K3ForCausalLM"], "model_type": "k3",
        "auto_map": {"AutoConfig": "modeling_k3.K3Config", "AutoModelForCausalLM": "modeling_k3.K3ForCausalLM"},
        "k3_config": yaml.safe_load(dump_config(cfg)),
        "vocab_size": cfg.model.vocab_size, "hidden_size": cfg.model.hidden_size,
        "num_hidden_layers": cfg.model.num_hidden_layers, "max_position_embeddings": cfg.train.seq_len,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id,
        "tie_word_embeddings": cfg.model.tie_word_embeddings, "use_cache": False, "torch_dtype": "float32",
    }


def _write_tokenizer(tok, out: Path, max_length: int) -> None:
    from tokenizers.processors import TemplateProcessing

    bos, eos = tok.id_to_token(tok.bos_id), tok.id_to_token(tok.eos_id)
    tok.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                            special_tokens=[(bos, tok.bos_id)])
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": bos, "eos_token": eos, "pad_token": eos, "unk_token": eos}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=1) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length, **special}, indent=1) + "\n")


def export_hf(run_dir: str | os.PathLike, ckpt: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Write checkpoint `ckpt` of `run_dir` as the Hugging Face folder `out`; returns {step, files}.
    Refuses (CheckpointError) an `out` that exists and is not an empty folder."""
    run_dir, ckpt, out = Path(run_dir), Path(ckpt), Path(out)
    if not is_free(out):
        raise CheckpointError(f"{out} already exists; refusing to overwrite it (choose a new --out)")
    config = run_dir / "config.yaml"
    cfg = load_config(str(config))
    with torch.device("meta"):
        expected = CausalLM(cfg.model).state_dict()
    state = load_full_model_state(ckpt)   # verifies the checkpoint's checksums
    check_fits(state, expected, f"{ckpt} does not fit {config}")
    step = json.loads((ckpt / MARKER).read_text()).get("step")
    tok = load_tokenizer(run_dir)

    def fill(tmp: Path) -> None:
        safetensors.torch.save_file({PREFIX + k: v.contiguous() for k, v in state.items()}, str(tmp / MODEL_FILE),
                                    metadata={"format": "pt", "step": str(step)})
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, tok.bos_id, tok.eos_id), indent=1) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.eos_id, "use_cache": False},
            indent=1) + "\n")
        shutil.copyfile(MODELING, tmp / MODELING.name)
        _write_tokenizer(tok, tmp, cfg.train.seq_len)

    build_folder(out, fill)
    return {"step": step, "files": sorted(p.name for p in out.iterdir())}
