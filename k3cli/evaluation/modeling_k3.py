"""A k3 model for Hugging Face transformers, loaded with `trust_remote_code=True`.

`k3 export --format hf` copies this file into the folder it writes. It builds k3's own `CausalLM`, so it
needs the `k3cli` package installed (the k3 repository: `pip install -e .`); the weights, the config
(`config.json`, whose `k3_config` is the run's resolved config) and the tokenizer are in the folder.
Sequences start with `<|endoftext|>` (id 0), as in training: the exported tokenizer adds it.
The forward has no key/value cache: `generate()` runs the whole sequence at every step (k3's own
`k3 generate` keeps a constant-cost decode cache instead).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class K3Config(PretrainedConfig):
    model_type = "k3"

    def __init__(self, k3_config: dict | None = None, **kwargs):
        self.k3_config = k3_config or {}
        kwargs.setdefault("use_cache", False)
        super().__init__(**kwargs)


class K3ForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = K3Config
    base_model_prefix = "k3"
    main_input_name = "input_ids"
    _supports_cache_class = False

    def __init__(self, config: K3Config):
        super().__init__(config)
        from k3cli.config import config_from_dict
        from k3cli.models.causal_lm import CausalLM

        self.k3 = CausalLM(config_from_dict(config.k3_config, "config.json k3_config").model)
        self.post_init()

    def _init_weights(self, module) -> None:
        # the weights come from model.safetensors; only the MoE's unsaved load counters start at zero
        if hasattr(module, "load_counts"):
            module.load_counts.zero_()

    def get_input_embeddings(self):
        return self.k3.embed_tokens

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs) -> CausalLMOutput:
        logits = self.k3(input_ids).logits
        loss = None
        if labels is not None:   # transformers' convention: labels are the inputs, -100 ignored, shifted here
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs) -> dict:
        return {"input_ids": input_ids}
