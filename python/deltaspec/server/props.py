"""llama-server's GET /props: what a client reads before it sends requests (each slot's context, the
slots, the chat template, the sampling defaults), in llama-server's shape. Nothing here changes
with a request; POST /props (llama-server's --props) is not served."""

from __future__ import annotations

import dataclasses

from .. import __version__
from ..sampling import SamplingOptions
from .schemas import Served


def props_body(served: Served, total_slots: int) -> dict:
    defaults = {k: v for k, v in dataclasses.asdict(SamplingOptions()).items() if k not in ("seed", "logit_bias")}
    template = served.template
    return {"default_generation_settings": {"n_ctx": served.n_ctx, "params": {**defaults, "n_predict": -1, "seed": -1}},
            "total_slots": total_slots, "model_alias": served.name,
            "model_path": served.aliases[0] if served.aliases else served.name,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": False, "endpoint_props": False, "endpoint_metrics": True,
            "chat_template": template.source if template is not None else "",
            "bos_token": template.bos_token if template is not None else "",
            "eos_token": template.eos_token if template is not None else "",
            "build_info": f"deltaspec {__version__}", "is_sleeping": False}
