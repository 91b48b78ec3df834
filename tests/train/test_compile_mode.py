"""train.compile and the optimizer kernel, resolved per device, task and strategy (issue 42
item 3): whole-model compile by default only where it pays and works (the LM on CUDA; the
surrogate's forces need a double backward), fused AdamW on CUDA unless FSDP shards."""

from __future__ import annotations

import pytest
import torch

from convergent.config import load_config
from convergent.core.errors import ConfigError
from convergent.train.parallel import compile_mode
from convergent.train.trainer import _adamw_kernel


class _Task:
    def __init__(self, double_backward: bool) -> None:
        self.double_backward = double_backward


CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_the_old_switch_reads_as_blocks_or_off_and_bad_values_name_the_key():
    assert load_config(None, ["train.compile=true"]).train.compile == "blocks"
    assert load_config(None, ["train.compile=false"]).train.compile == "off"
    assert load_config(None, []).train.compile == "auto"
    with pytest.raises(ConfigError, match="train.compile"):
        load_config(None, ["train.compile=fast"])


@pytest.mark.parametrize("setting, device, double, strategy, want", [
    ("auto", CUDA, False, "ddp", "model"),      # the LM on a GPU: one graph
    ("auto", CUDA, True, "ddp", "off"),         # the surrogate: forces by double backward
    ("auto", CPU, False, "single", "off"),      # CPU: eager
    ("model", CUDA, False, "pipeline", "blocks"),  # a stage holds a slice: its blocks
    ("blocks", CPU, True, "single", "blocks"),  # asked for: done
    ("off", CUDA, False, "single", "off"),
])
def test_compile_mode(setting, device, double, strategy, want):
    cfg = load_config(None, [f"train.compile={setting}"])
    assert compile_mode(cfg, _Task(double), device, strategy) == want


def test_adamw_kernel_per_device_and_strategy():
    assert _adamw_kernel(CPU, "single") == {}
    assert _adamw_kernel(CUDA, "single") == _adamw_kernel(CUDA, "ddp") == {"fused": True}
    assert _adamw_kernel(CUDA, "fsdp") == {"foreach": True}
