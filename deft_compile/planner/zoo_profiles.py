"""Paper-scale profiles: ResNet-101, VGG-19 (ImageNet 224²) and GPT-2 124M on A100s.

Why analytic profiles: the paper's testbed (16 A100 GPUs) is not available;
the planner only needs per-layer times and gradient sizes, which follow from
the exact parameter shapes and FLOP counts written below (no torchvision).

Assumptions (all overridable through ``build_profile``):

* Compute: A100, mixed precision, tensor-core peak ``peak_tflops`` = 312
  TFLOP/s at ``efficiency`` = 0.4 of peak for matmuls/convolutions; memory-bound
  ops (BatchNorm, ReLU, pooling, LayerNorm, GELU, residual adds) move their
  activations through HBM at 0.7 × 1555 GB/s, fp16 activations. Backward =
  2 × forward for every layer. Optimizer update (SGD with momentum for the
  CNNs, AdamW for GPT-2) is memory-bound: 16 (SGD-m) or 28 (AdamW) bytes of
  HBM traffic per parameter.
* Gradients are fp32 (AMP keeps fp32 master weights), so 4 bytes/param go
  over the wire.
* Network: ``gpus`` GPUs as nodes of ``gpus_per_node`` (default 4 × 4),
  NVLink inside a node (``intra_gbps`` = 2000 Gbit/s effective), one NIC of
  ``inter_gbps`` (default 25 Gbit/s) per node at 90 % goodput. The all-reduce
  is hierarchical: reduce-scatter inside the node, ring all-reduce of the
  shards across nodes (the node's NIC carries 2(N−1)/N of the bucket), all-
  gather inside the node. β folds all of it:
  β = 2(N−1)/N / B_inter + 2(g−1)/g / B_intra. Latency α = 20 µs launch +
  2·ceil(log2 N)·15 µs across nodes + 2(g−1)·3 µs inside — tree-like latency,
  as NCCL picks tree for small messages and ring for large ones.
* Optional second link (DeFT's heterogeneous links): a host-NIC path of
  ``extra_link_gbps`` per node with 100 µs extra latency, ring over nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deft_compile.planner.plan import LinkCost, ParamProfile, Profile

A100_PEAK_TFLOPS = 312.0
A100_HBM_GBPS = 1555.0
HBM_EFFICIENCY = 0.7
NET_GOODPUT = 0.9
ACT_BYTES = 2  # fp16 activations
GRAD_DTYPE = "float32"
MODELS = ("resnet101", "vgg19", "gpt2")
DEFAULT_BATCH = {"resnet101": 64, "vgg19": 64, "gpt2": 8}


@dataclass
class LayerSpec:
    """One layer of the table: its parameters, matmul FLOPs and memory-bound traffic per sample."""

    name: str
    params: list[tuple[str, int]]  # (name, numel) in registration order
    flops: float  # forward FLOPs per sample (2 per MAC)
    mem_bytes: float = 0.0  # forward bytes moved by memory-bound ops per sample


# --- layer tables --------------------------------------------------------------------


def resnet101_layers() -> list[LayerSpec]:
    """torchvision resnet101 (v1.5: stride on the 3x3 conv), 224x224 input."""
    layers: list[LayerSpec] = []

    def conv_bn(name: str, cin: int, cout: int, k: int, out_hw: int) -> None:
        act = cout * out_hw * out_hw
        layers.append(LayerSpec(name, [(f"{name}.conv.weight", cout * cin * k * k),
                                       (f"{name}.bn.weight", cout), (f"{name}.bn.bias", cout)],
                                flops=2.0 * cin * cout * k * k * out_hw * out_hw,
                                mem_bytes=4.0 * act * ACT_BYTES))  # BN r/w + ReLU r/w

    conv_bn("stem", 3, 64, 7, 112)
    hw = 56  # after max-pool
    cin = 64
    for stage, (blocks, width, stride) in enumerate([(3, 64, 1), (4, 128, 2), (23, 256, 2), (3, 512, 2)],
                                                     start=1):
        cout = width * 4
        for b in range(blocks):
            s = stride if b == 0 else 1
            out_hw = hw // s
            prefix = f"layer{stage}.{b}"
            conv_bn(f"{prefix}.conv1", cin, width, 1, hw)
            conv_bn(f"{prefix}.conv2", width, width, 3, out_hw)
            conv_bn(f"{prefix}.conv3", width, cout, 1, out_hw)
            if b == 0:
                conv_bn(f"{prefix}.downsample", cin, cout, 1, out_hw)
            layers[-1].mem_bytes += 3.0 * cout * out_hw * out_hw * ACT_BYTES  # residual add
            cin, hw = cout, out_hw
    layers.append(LayerSpec("fc", [("fc.weight", 2048 * 1000), ("fc.bias", 1000)],
                            flops=2.0 * 2048 * 1000, mem_bytes=2048 * 49 * ACT_BYTES))
    return layers


def vgg19_layers() -> list[LayerSpec]:
    """torchvision vgg19 (no BN), 224x224 input."""
    config = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
              512, 512, 512, 512, "M", 512, 512, 512, 512, "M"]
    layers: list[LayerSpec] = []
    cin, hw, index = 3, 224, 0
    for entry in config:
        if entry == "M":
            layers[-1].mem_bytes += 1.25 * cin * hw * hw * ACT_BYTES  # max-pool read + write/4
            hw //= 2
            continue
        cout = int(entry)
        act = cout * hw * hw
        layers.append(LayerSpec(f"features.{index}", [(f"features.{index}.weight", cout * cin * 9),
                                                      (f"features.{index}.bias", cout)],
                                flops=2.0 * cin * cout * 9 * hw * hw, mem_bytes=2.0 * act * ACT_BYTES))
        cin = cout
        index += 2
    for i, (fin, fout) in enumerate([(512 * 7 * 7, 4096), (4096, 4096), (4096, 1000)]):
        layers.append(LayerSpec(f"classifier.{3 * i}", [(f"classifier.{3 * i}.weight", fin * fout),
                                                        (f"classifier.{3 * i}.bias", fout)],
                                flops=2.0 * fin * fout, mem_bytes=2.0 * fout * ACT_BYTES))
    return layers


def gpt2_layers(seq: int = 1024) -> tuple[list[LayerSpec], float]:
    """GPT-2 small (124M): 12 layers, d=768, 12 heads, vocab 50257, tied LM head.

    Returns the layers (per *sequence* of ``seq`` tokens) and the FLOPs of the
    tied LM head per sequence, which run at the end of the forward, outside
    any parameter's layer (they are the Profile's extra forward/backward).
    """
    d, vocab, n_layer = 768, 50257, 12
    layers = [LayerSpec("embed", [("wte.weight", vocab * d), ("wpe.weight", seq * d)], flops=0.0,
                        mem_bytes=3.0 * seq * d * ACT_BYTES)]
    for i in range(n_layer):
        p = f"h.{i}"
        layers.append(LayerSpec(f"{p}.attn", [
            (f"{p}.ln_1.weight", d), (f"{p}.ln_1.bias", d),
            (f"{p}.attn.c_attn.weight", d * 3 * d), (f"{p}.attn.c_attn.bias", 3 * d),
            (f"{p}.attn.c_proj.weight", d * d), (f"{p}.attn.c_proj.bias", d)],
            # QKV + out projection + QK^T and AV (flash attention: no T x T traffic)
            flops=seq * (2.0 * 4 * d * d + 4.0 * seq * d),
            mem_bytes=seq * d * ACT_BYTES * 8.0))
        layers.append(LayerSpec(f"{p}.mlp", [
            (f"{p}.ln_2.weight", d), (f"{p}.ln_2.bias", d),
            (f"{p}.mlp.c_fc.weight", d * 4 * d), (f"{p}.mlp.c_fc.bias", 4 * d),
            (f"{p}.mlp.c_proj.weight", 4 * d * d), (f"{p}.mlp.c_proj.bias", d)],
            flops=seq * 2.0 * 8 * d * d,
            mem_bytes=seq * d * ACT_BYTES * 14.0))  # LN, GELU on 4d, residual
    layers.append(LayerSpec("ln_f", [("ln_f.weight", d), ("ln_f.bias", d)], flops=0.0,
                            mem_bytes=seq * d * ACT_BYTES * 2.0))
    head_flops = seq * 2.0 * d * vocab
    return layers, head_flops


# --- network ------------------------------------------------------------------------


def hierarchical_allreduce(gpus: int, gpus_per_node: int, inter_gbps: float,
                           intra_gbps: float) -> LinkCost:
    """α–β cost of a hierarchical all-reduce (see module docstring)."""
    g = max(1, min(gpus_per_node, gpus))
    nodes = math.ceil(gpus / g)
    beta = 0.0
    alpha = 0.020
    if nodes > 1:
        bytes_per_ms_inter = inter_gbps * NET_GOODPUT * 1e9 / 8 / 1e3
        beta += 2.0 * (nodes - 1) / nodes / bytes_per_ms_inter
        alpha += 2 * math.ceil(math.log2(nodes)) * 0.015
    if g > 1:
        bytes_per_ms_intra = intra_gbps * 1e9 / 8 / 1e3
        beta += 2.0 * (g - 1) / g / bytes_per_ms_intra
        alpha += 2 * (g - 1) * 0.003
    return LinkCost(f"hier {nodes}x{g} {inter_gbps:g}G/{intra_gbps:g}G", alpha, beta)


def host_nic_allreduce(gpus: int, gpus_per_node: int, gbps: float) -> LinkCost:
    """A second, slower path (gloo over a host NIC): ring over nodes, +100 µs latency."""
    g = max(1, min(gpus_per_node, gpus))
    nodes = max(2, math.ceil(gpus / g))
    bytes_per_ms = gbps * NET_GOODPUT * 1e9 / 8 / 1e3
    beta = 2.0 * (nodes - 1) / nodes / bytes_per_ms
    alpha = 0.120 + 2 * math.ceil(math.log2(nodes)) * 0.030
    return LinkCost(f"host-nic {nodes} nodes {gbps:g}G", alpha, beta)


# --- profiles ------------------------------------------------------------------------


def _profile(name: str, layers: list[LayerSpec], samples: int, *, efficiency: float,
             peak_tflops: float, update_bytes_per_param: float, links: list[LinkCost],
             world_size: int, extra_forward_flops: float = 0.0,
             extra_mem_bytes: float = 0.0) -> Profile:
    flops_per_ms = peak_tflops * 1e12 * efficiency / 1e3
    hbm_bytes_per_ms = A100_HBM_GBPS * 1e9 * HBM_EFFICIENCY / 1e3
    forward_order: list[ParamProfile] = []
    for index, layer in enumerate(layers):
        forward_ms = samples * (layer.flops / flops_per_ms + layer.mem_bytes / hbm_bytes_per_ms)
        for j, (pname, numel) in enumerate(layer.params):
            on_first = j == 0  # the layer's time sits on its first parameter
            forward_order.append(ParamProfile(
                name=pname, numel=int(numel), dtype=GRAD_DTYPE,
                forward_ms=forward_ms if on_first else 0.0,
                backward_ms=2.0 * forward_ms if on_first else 0.0,
                update_ms=numel * update_bytes_per_param / hbm_bytes_per_ms, layer=index))
    # gradient-ready order is the reverse of the forward (DDP registers reversed params)
    ready_order = list(reversed(forward_order))
    extra_forward = samples * (extra_forward_flops / flops_per_ms + extra_mem_bytes / hbm_bytes_per_ms)
    return Profile(params=ready_order, links=links, world_size=world_size,
                   extra_forward_ms=extra_forward, extra_backward_ms=2.0 * extra_forward, name=name)


def build_profile(
    model: str,
    *,
    gpus: int = 16,
    gpus_per_node: int = 4,
    inter_gbps: float = 25.0,
    intra_gbps: float = 2000.0,
    efficiency: float = 0.4,
    peak_tflops: float = A100_PEAK_TFLOPS,
    batch: int | None = None,
    extra_link_gbps: float = 0.0,
) -> Profile:
    """Profile of ``model`` (resnet101, vgg19, gpt2) on the stated cluster.

    ``batch`` is per GPU: images for the CNNs (default 64), sequences of 1024
    tokens for GPT-2 (default 8).
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    if gpus < 2:
        raise ValueError("data parallelism needs at least 2 GPUs")
    batch = DEFAULT_BATCH[model] if batch is None else batch
    links = [hierarchical_allreduce(gpus, gpus_per_node, inter_gbps, intra_gbps)]
    if extra_link_gbps > 0:
        links.append(host_nic_allreduce(gpus, gpus_per_node, extra_link_gbps))
    name = f"{model} b{batch} {gpus}gpu"
    common = dict(efficiency=efficiency, peak_tflops=peak_tflops, links=links, world_size=gpus)
    if model == "resnet101":
        return _profile(name, resnet101_layers(), batch, update_bytes_per_param=16.0,
                        extra_mem_bytes=1000 * 4 * 4, **common)
    if model == "vgg19":
        return _profile(name, vgg19_layers(), batch, update_bytes_per_param=16.0,
                        extra_mem_bytes=1000 * 4 * 4, **common)
    layers, head_flops = gpt2_layers()
    return _profile(name, layers, batch, update_bytes_per_param=28.0,
                    extra_forward_flops=head_flops, extra_mem_bytes=1024 * 50257 * 4 * 2, **common)


def model_summary(profile: Profile) -> dict[str, float]:
    """Parameters, gradient MB and the merged compute times, for tables and checks."""
    return {"params": sum(p.numel for p in profile.params), "grad_mb": profile.total_bytes / 1e6,
            "forward_ms": profile.forward_ms, "backward_ms": profile.backward_ms,
            "update_ms": profile.update_ms}
