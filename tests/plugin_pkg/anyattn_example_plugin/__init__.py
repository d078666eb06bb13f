"""An example out-of-tree anyattn backend: declarations only, enough for selection.

Installing this package makes `EXAMPLE_PLUGIN` appear in `anyattn backends` through the
`anyattn.backends` entry-point group; nothing in anyattn names it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from anyattn.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
from anyattn.types import MultipleOf


class ExamplePluginImpl(AttentionImpl[None]):
    """The base constructor checks and keeps the arguments against `backend` (set below)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        raise NotImplementedError("ExamplePluginImpl.forward: the example plugin has no kernel.")


class ExamplePluginBuilder(AttentionMetadataBuilder[None]):
    def build(self, common_prefix_len, common_attn_metadata) -> None:
        return None


class ExamplePluginBackend(AttentionBackend):
    """CPU-only, float32-only, head sizes 64 and 128, kernel blocks of a multiple of 16."""

    supported_dtypes = (torch.float32,)
    supported_device_types = ("cpu",)
    priority: ClassVar[Mapping[str, int]] = {"cpu": 10}

    @staticmethod
    def get_name() -> str:
        return "EXAMPLE_PLUGIN"

    @staticmethod
    def get_impl_cls() -> type[ExamplePluginImpl]:
        return ExamplePluginImpl

    @staticmethod
    def get_builder_cls() -> type[ExamplePluginBuilder]:
        return ExamplePluginBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [64, 128]

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[int | MultipleOf]:
        return [MultipleOf(16)]


ExamplePluginImpl.backend = ExamplePluginBackend
