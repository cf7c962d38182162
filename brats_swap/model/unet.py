"""The Isensee 2017 3D U-Net exactly as Ellis's Keras `isensee2017_model` (the IBM data-swapping paper's model).

Sources: Isensee et al. 2017 (BraTS 2017 proceedings, arXiv:1802.10508) as implemented in Ellis's
`3DUnetCNN` (`isensee2017_model`), which the IBM paper trained. For depth 5 and 16 base filters:

    encoder level l (filters F_l = 16 * 2**l):
        h = in_conv(x)                          3³ ConvNormAct, stride 1 at level 0, stride 2 below
        out_l = h + context(h)                  context = block1 -> Dropout3d -> block2 (3³ each)
    decoder level l = depth-2 ... 0:
        up = upsample(current)                  nearest x2 then a 3³ ConvNormAct down to F_l
        current = localization(cat[out_l, up])  3³ ConvNormAct then 1³ ConvNormAct, both F_l
        seg_l = segmentation(current)           only for l < segmentation_levels
    deep supervision: s = seg_2; s = up(s) + seg_1; s = up(s) + seg_0; return sigmoid(s)

ConvNormAct = Conv3d (bias) -> instance norm (affine, keras_contrib semantics) -> LeakyReLU. Parameters:
8,269,579 with norm+activation in the segmentation layers (IBM fork, `seg_layer: norm_act`) and 8,269,561
with a plain 1³ conv (Ellis master after PR #130, `seg_layer: conv`), for 4 inputs and 3 outputs.

Module names are a contract: memory policies select saved tensors by globs over them
(`encoder.level0.context.block1.norm`, `decoder.*`), so they are spelled out here and never generated
from a list index. The model knows nothing about the memory engine, but it is written so that no tensor
outlives its use: the two decoder convolutions whose input is an upsampled or concatenated tensor save
their parts instead (`NearestUpsampleConv3d`, `ConcatConv3d`), and a decoder level releases its upsampled
tensor as soon as it is read. Outputs are bitwise those of the plain layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from brats_swap.config.schema import ModelConfig
from brats_swap.errors import ConfigError


class ModelInputError(ConfigError, ValueError):
    """An input the network cannot take (wrong rank, channels, or a size not divisible by 2**(depth-1)).

    A ValueError for library callers; a ConfigError (exit 2) for the CLI, because the cause is almost
    always `data.cube` or `train.patch` in the config.
    """


# --------------------------------------------------------------------------------------------------------
# Instance normalization with keras_contrib semantics.
#
# We write our own instead of nn.InstanceNorm3d because keras_contrib's InstanceNormalization (what Ellis
# and IBM trained with) computes (x - mean) / (std + eps) * gamma + beta with eps=1e-3 ADDED TO THE STD,
# while PyTorch computes (x - mean) / sqrt(var + eps). The backward is hand-written so that, like
# F.instance_norm, the only full-size tensor saved for backward is the input (the conv output); composing
# the formula from torch ops would save two or three full-size intermediates per block, which is exactly
# the memory this project is about. Statistics and gradients are computed in fp32 under AMP as well.
# --------------------------------------------------------------------------------------------------------


# A channel slice of the norm's working set is kept to about this many bytes (fp32). Small tensors take
# one slice (one kernel per op, as unchunked); large ones up to eight.
_NORM_CHUNK_BYTES = 64 * 2**20
_NORM_MAX_CHUNKS = 8


def _channel_chunks(x: torch.Tensor) -> list[slice]:
    """Channel slices the norm works through one at a time, so its full-size temporaries shrink up to 8x.

    The instance-norm backward needs the centred input, the normalised input and several products of the
    same size; computed at once they are about six full-size fp32 tensors, which set the memory floor of the
    whole step at large volumes. Statistics are per channel, so working through channel slices is exact.
    """
    return _channel_slices(x.shape[1], x.numel() * 4)


def _channel_slices(channels: int, nbytes: int) -> list[slice]:
    """Up to eight channel slices of about `_NORM_CHUNK_BYTES` each for a tensor of `nbytes` (one when small).

    A slice holds at least two channels because a single-channel slice is contiguous and takes a different
    (differently rounded) reduction kernel than the unsliced op.
    """
    wanted = min(_NORM_MAX_CHUNKS, max(1, nbytes // _NORM_CHUNK_BYTES))
    size = max(2, -(-channels // wanted))
    starts = list(range(0, channels, size))
    if len(starts) > 1 and channels - starts[-1] == 1:
        starts.pop()  # a last slice of one channel joins the one before it
    return [slice(start, stop) for start, stop in zip(starts, starts[1:] + [channels], strict=True)]


class _KerasInstanceNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        dims = tuple(range(2, x.dim()))
        compute_dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 for bf16/fp16, fp64 stays fp64
        shape = (1, -1) + (1,) * len(dims)
        stats_shape = (x.shape[0], x.shape[1]) + (1,) * len(dims)
        mean = x.new_empty(stats_shape, dtype=compute_dtype)
        std = x.new_empty(stats_shape, dtype=compute_dtype)
        out = torch.empty_like(x)
        for chunk in _channel_chunks(x):
            x32 = x[:, chunk].to(compute_dtype)
            mean[:, chunk] = x32.mean(dim=dims, keepdim=True)
            centered = x32 - mean[:, chunk]
            std[:, chunk] = centered.square().mean(dim=dims, keepdim=True).sqrt()
            scale = weight[chunk].to(compute_dtype).view(shape) / (std[:, chunk] + eps)
            out[:, chunk] = centered * scale + bias[chunk].to(compute_dtype).view(shape)
        ctx.eps = eps
        ctx.save_for_backward(x, weight, mean, std)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        # With xc = x - mean, sigma = sqrt(mean(xc²)), s = sigma + eps, xhat = xc / s and g = grad_out * gamma:
        #   d bias  = sum(grad_out)            d gamma = sum(grad_out * xhat)       (over batch and space)
        #   d x     = (g - mean(g) - xc / sigma * mean(g * xhat)) / s               (means over space)
        # A constant channel has sigma = 0 and xc = 0; its last term is 0 in the limit, hence the clamp.
        x, weight, mean, std = ctx.saved_tensors
        dims = tuple(range(2, x.dim()))
        shape = (1, -1) + (1,) * len(dims)
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_x = torch.empty_like(x) if need_x else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        grad_bias = torch.empty_like(weight) if need_bias else None
        for chunk in _channel_chunks(x):
            grad32 = grad_out[:, chunk].to(mean.dtype)
            centered = x[:, chunk].to(mean.dtype) - mean[:, chunk]
            denom = std[:, chunk] + ctx.eps
            xhat = centered / denom
            if need_bias:
                grad_bias[chunk] = grad32.sum(dim=(0,) + dims).to(weight.dtype)
            if need_weight:
                grad_weight[chunk] = (grad32 * xhat).sum(dim=(0,) + dims).to(weight.dtype)
            if need_x:
                g = grad32 * weight[chunk].to(mean.dtype).view(shape)
                g_mean = g.mean(dim=dims, keepdim=True)
                g_xhat_mean = (g * xhat).mean(dim=dims, keepdim=True)
                del xhat
                sigma = std[:, chunk].clamp_min(torch.finfo(std.dtype).tiny)
                grad_x[:, chunk] = (g - g_mean - centered / sigma * g_xhat_mean) / denom
        return grad_x, grad_weight, grad_bias, None


class KerasInstanceNorm(nn.Module):
    """Per-sample, per-channel normalization over the spatial axes: (x - mean) / (std + eps) * weight + bias.

    No running statistics (train and eval behave the same, as in keras_contrib). `weight` starts at 1
    and `bias` at 0, like Keras' `gamma`/`beta`.
    """

    replayable_norm = True  # forward(x) is pure in (x, weight, bias): memory's norm_act may re-run it

    def __init__(self, channels: int, eps: float = 1e-3):
        super().__init__()
        self.channels = channels
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _KerasInstanceNormFunction.apply(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.channels}, eps={self.eps}"


def keras_instance_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                                  eps: float) -> torch.Tensor:
    """The same formula from plain torch ops (autograd does the backward). Used by the tests as the oracle."""
    dims = tuple(range(2, x.dim()))
    shape = (1, -1) + (1,) * len(dims)
    mean = x.mean(dim=dims, keepdim=True)
    std = x.std(dim=dims, keepdim=True, unbiased=False)
    return (x - mean) / (std + eps) * weight.view(shape) + bias.view(shape)


# --------------------------------------------------------------------------------------------------------
# Convolutions over a prepared input: nearest x2 upsampling, or a channel concatenation.
#
# Two decoder convolutions read an input that exists only to be convolved: the nearest-upsampled coarse
# features (upsample block: 2F channels at the fine resolution) and the concatenation [skip, up]
# (localization block1: 2F channels). Autograd would save each for backward, and its gradient would be
# one full-size tensor whose skip half stays alive until the encoder's backward; at 336³ each is 4.5 GiB,
# the largest tensors of the step. Both inputs are cheap to rebuild from tensors the step keeps anyway
# (the coarse features, the skip, the upsample block's output), so this convolution saves those parts and
# rebuilds the input in backward, part by part and channel slice by channel slice for large tensors.
# The forward runs the very ops of the unfused layers (`F.interpolate` or `torch.cat`, then `F.conv3d`),
# so outputs are bitwise theirs; a small input's backward is the one `convolution_backward` call autograd
# makes, so gradients are bitwise theirs too. Large inputs' gradients equal them up to rounding.
# --------------------------------------------------------------------------------------------------------


def _prepared(parts: Sequence[torch.Tensor], upsample: bool) -> torch.Tensor:
    x = parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=1)
    return F.interpolate(x, scale_factor=2, mode="nearest") if upsample else x


def _nearest_backward(grad: torch.Tensor) -> torch.Tensor:
    """The gradient of `F.interpolate(x, scale_factor=2, mode="nearest")` w.r.t. x (autograd's own op)."""
    coarse = [grad.shape[0], grad.shape[1], *(size // 2 for size in grad.shape[2:])]
    return torch.ops.aten.upsample_nearest3d_backward(grad, list(grad.shape[2:]), coarse, 2.0, 2.0, 2.0)


class _PreparedInputConvFunction(torch.autograd.Function):
    """conv3d(prepared(parts), weight, bias) that saves `parts`, not the prepared input, for backward."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple, padding: tuple,
                upsample: bool, *parts: torch.Tensor) -> torch.Tensor:
        x = _prepared(parts, upsample)
        out = F.conv3d(x, weight, bias, stride, padding)
        ctx.stride, ctx.padding, ctx.upsample = list(stride), list(padding), upsample
        ctx.input_bytes = x.numel() * out.element_size()  # the prepared input in the dtype it was convolved in
        ctx.has_bias = bias is not None
        ctx.save_for_backward(weight, *parts)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        weight, *parts = ctx.saved_tensors
        upsample, input_bytes = ctx.upsample, ctx.input_bytes
        need_parts = ctx.needs_input_grad[5:]
        need_weight, need_bias = ctx.needs_input_grad[0], ctx.has_bias and ctx.needs_input_grad[1]
        kernel = weight.to(grad_out.dtype)  # the dtype the forward convolved in (autocast's copy)
        channels = sum(part.shape[1] for part in parts)
        if len(_channel_slices(channels, input_bytes)) == 1:
            x = _prepared(parts, upsample).to(grad_out.dtype)
            grad_x, grad_weight, grad_bias = _conv_backward(ctx, grad_out, x, kernel,
                                                            (any(need_parts), need_weight, need_bias))
            del x
            if grad_x is not None and upsample:
                grad_x = _nearest_backward(grad_x)
            grads = _split_channels(grad_x, parts, need_parts)
        else:
            grads, grad_weight, grad_bias = _sliced_backward(ctx, grad_out, parts, kernel, input_bytes // channels,
                                                             need_parts, need_weight, need_bias)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(weight.dtype)
        return (grad_weight, grad_bias, None, None, None, *grads)


def _conv_backward(ctx, grad_out: torch.Tensor, x: torch.Tensor, kernel: torch.Tensor, mask: tuple):
    bias_sizes = [kernel.shape[0]] if mask[2] else None
    return torch.ops.aten.convolution_backward(grad_out, x, kernel, bias_sizes, ctx.stride, ctx.padding, [1, 1, 1],
                                               False, [0, 0, 0], 1, list(mask))


def _split_channels(grad_x: torch.Tensor | None, parts: list[torch.Tensor], need_parts) -> list:
    """The gradient of the concatenation cut into one contiguous tensor per part, in each part's dtype.

    Contiguous copies rather than views: a view of the skip's half would keep the whole concatenated
    gradient alive until the encoder's backward accumulates the skip's gradient.
    """
    if grad_x is None:
        return [None] * len(parts)
    if len(parts) == 1:
        return [grad_x.to(parts[0].dtype) if need_parts[0] else None]
    grads, start = [], 0
    for part, needed in zip(parts, need_parts, strict=True):
        width = part.shape[1]
        grads.append(grad_x[:, start:start + width].to(part.dtype, copy=True) if needed else None)
        start += width
    return grads


def _sliced_backward(ctx, grad_out: torch.Tensor, parts: list, kernel: torch.Tensor, bytes_per_channel: int,
                     need_parts, need_weight: bool, need_bias: bool):
    """The backward of a large prepared input: one part at a time (last first, each dropped when done) and
    within a part one channel slice at a time, so neither the prepared input nor its gradient is ever whole.
    Per input channel the products summed are the same as unsliced; only the kernels' rounding may differ."""
    upsample = ctx.upsample
    grads: list[torch.Tensor | None] = [None] * len(parts)
    grad_weight = torch.empty_like(kernel) if need_weight else None
    grad_bias = None
    offsets = [sum(part.shape[1] for part in parts[:index]) for index in range(len(parts))]
    for index in reversed(range(len(parts))):
        part, parts[index] = parts[index], None  # this frame's reference is the last once autograd unpacked it
        if need_parts[index]:
            grads[index] = torch.empty_like(part)
        for chunk in _channel_slices(part.shape[1], part.shape[1] * bytes_per_channel):
            x = _prepared([part[:, chunk]], upsample).to(grad_out.dtype)
            columns = slice(offsets[index] + chunk.start, offsets[index] + chunk.stop)
            mask = (need_parts[index], need_weight, need_bias and grad_bias is None)
            grad_x, grad_w, grad_b = _conv_backward(ctx, grad_out, x, kernel[:, columns], mask)
            del x
            if grad_b is not None:
                grad_bias = grad_b
            if grad_w is not None:
                grad_weight[:, columns] = grad_w
            if grad_x is not None:
                grads[index][:, chunk] = _nearest_backward(grad_x) if upsample else grad_x
        del part
    if need_bias and grad_bias is None:  # no slice asked for the bias (nothing else needed a gradient)
        grad_bias = grad_out.sum(dim=(0, 2, 3, 4))
    return grads, grad_weight, grad_bias


class NearestUpsampleConv3d(nn.Conv3d):
    """Nearest x2 upsampling (Keras UpSampling3D) then this convolution; saves the coarse input, 1/8 the size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PreparedInputConvFunction.apply(self.weight, self.bias, self.stride, self.padding, True, x)


class ConcatConv3d(nn.Conv3d):
    """This convolution over the channel concatenation of its inputs; saves the inputs, not the concatenation."""

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return _PreparedInputConvFunction.apply(self.weight, self.bias, self.stride, self.padding, False, *inputs)


# --------------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------------


class ConvNormAct(nn.Module):
    """Ellis's `create_convolution_block`: Conv3d (with bias, 'same' padding) -> instance norm -> LeakyReLU.

    Stride-2 convolutions pad 1 voxel on both sides where TensorFlow's 'same' pads 0 before and 1 after:
    the output shape is the same and the sampling grid is shifted by one voxel, which does not matter when
    training from scratch, and it avoids a padded copy of every skip tensor being saved for backward.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1,
                 leaky_slope: float = 0.3, norm_eps: float = 1e-3, conv_type: type[nn.Conv3d] = nn.Conv3d):
        super().__init__()
        self.conv = conv_type(in_channels, out_channels, kernel_size, stride=stride, padding=kernel_size // 2,
                              bias=True)
        self.norm = KerasInstanceNorm(out_channels, eps=norm_eps)
        # Out of place so every saved tensor is a distinct, well-defined activation for the memory engine.
        self.act = nn.LeakyReLU(leaky_slope, inplace=False)

    # forward(*x) is act(norm(conv(*x))): under `train.compile` memory's compiled regions run the conv eager
    # and the norm -> act chain compiled (docs/memory.md#compiled-steps).
    conv_then_chain = ("conv", "norm", "act")

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.conv(*inputs)))


class ContextModule(nn.Module):
    """Two 3³ conv blocks with channel dropout between them (Keras SpatialDropout3D = nn.Dropout3d)."""

    def __init__(self, channels: int, dropout: float, leaky_slope: float, norm_eps: float):
        super().__init__()
        self.block1 = ConvNormAct(channels, channels, 3, leaky_slope=leaky_slope, norm_eps=norm_eps)
        self.dropout = nn.Dropout3d(dropout) if dropout > 0 else nn.Identity()
        self.block2 = ConvNormAct(channels, channels, 3, leaky_slope=leaky_slope, norm_eps=norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block2(self.dropout(self.block1(x)))


class EncoderLevel(nn.Module):
    """in_conv (stride 2 below level 0), then a residual context module: out = h + context(h)."""

    def __init__(self, in_channels: int, channels: int, stride: int, dropout: float, leaky_slope: float,
                 norm_eps: float):
        super().__init__()
        self.in_conv = ConvNormAct(in_channels, channels, 3, stride=stride, leaky_slope=leaky_slope,
                                   norm_eps=norm_eps)
        self.context = ContextModule(channels, dropout, leaky_slope, norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.in_conv(x)
        return h + self.context(h)


class UpsampleModule(nn.Module):
    """Nearest-neighbour x2 (Keras UpSampling3D), then a 3³ conv block that halves the channels.

    The upsampling is part of the block's convolution (`NearestUpsampleConv3d`), which saves the coarse
    input for backward instead of its 8x larger upsampled copy.
    """

    def __init__(self, in_channels: int, out_channels: int, leaky_slope: float, norm_eps: float):
        super().__init__()
        self.block = ConvNormAct(in_channels, out_channels, 3, leaky_slope=leaky_slope, norm_eps=norm_eps,
                                 conv_type=NearestUpsampleConv3d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class LocalizationModule(nn.Module):
    """A 3³ conv block from the concatenation [skip, up] (2F) to F, then a 1³ conv block keeping F (Ellis, not
    Isensee). block1's convolution concatenates (`ConcatConv3d`), so the concatenation is never stored."""

    def __init__(self, in_channels: int, channels: int, leaky_slope: float, norm_eps: float):
        super().__init__()
        self.block1 = ConvNormAct(in_channels, channels, 3, leaky_slope=leaky_slope, norm_eps=norm_eps,
                                  conv_type=ConcatConv3d)
        self.block2 = ConvNormAct(channels, channels, 1, leaky_slope=leaky_slope, norm_eps=norm_eps)

    def forward(self, skip: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.block2(self.block1(skip, up))


class DecoderLevel(nn.Module):
    """Upsample the coarser features, concatenate with the skip (skip first), localize, maybe segment."""

    def __init__(self, in_channels: int, channels: int, out_channels: int, with_segmentation: bool,
                 seg_layer: str, leaky_slope: float, norm_eps: float):
        super().__init__()
        self.upsample = UpsampleModule(in_channels, channels, leaky_slope, norm_eps)
        self.localization = LocalizationModule(2 * channels, channels, leaky_slope, norm_eps)
        if with_segmentation:
            if seg_layer == "norm_act":  # 3ececcb / IBM fork
                self.segmentation = ConvNormAct(channels, out_channels, 1, leaky_slope=leaky_slope,
                                                norm_eps=norm_eps)
            else:  # Ellis master after PR #130: a linear 1³ conv
                self.segmentation = nn.Conv3d(channels, out_channels, 1, bias=True)
        else:
            self.segmentation = None

    def forward(self, coarse: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        # The localization's blocks run from here, not through `self.localization(skip, up)`: arguments of
        # a running module call stay referenced until it returns, so the upsampled tensor (F channels at
        # this level's full resolution) would stay on the device through block2. Called like this it is
        # released once block1 has read it (the same ops in the same order as `LocalizationModule.forward`).
        localization = self.localization
        return localization.block2(localization.block1(skip, self.upsample(coarse)))


# --------------------------------------------------------------------------------------------------------
# The network
# --------------------------------------------------------------------------------------------------------


class Isensee2017UNet(nn.Module):
    """Forward: (B, in_channels, D, H, W) -> (B, out_channels, D, H, W) sigmoid probabilities.

    D, H and W must be divisible by `size_divisor` = 2**(depth-1).
    """

    def __init__(self, cfg: ModelConfig, out_channels: int = 3):
        super().__init__()
        _validate_config(cfg, out_channels)
        self.in_channels = cfg.in_channels
        self.out_channels = out_channels
        self.depth = cfg.depth
        self.segmentation_levels = cfg.segmentation_levels
        self.size_divisor = 2 ** (cfg.depth - 1)
        filters = [cfg.base_filters * 2**level for level in range(cfg.depth)]
        slope, eps = cfg.leaky_slope, cfg.norm_eps

        self.encoder = nn.ModuleDict()
        for level in range(cfg.depth):
            in_ch = cfg.in_channels if level == 0 else filters[level - 1]
            stride = 1 if level == 0 else 2
            self.encoder[f"level{level}"] = EncoderLevel(in_ch, filters[level], stride, cfg.dropout, slope, eps)

        # Registered deepest first, so iterating the dict follows the forward order.
        self.decoder = nn.ModuleDict()
        for level in reversed(range(cfg.depth - 1)):
            self.decoder[f"level{level}"] = DecoderLevel(
                filters[level + 1], filters[level], out_channels,
                with_segmentation=level < cfg.segmentation_levels, seg_layer=cfg.seg_layer,
                leaky_slope=slope, norm_eps=eps,
            )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Keras defaults: glorot (xavier) uniform conv kernels, zero biases; norm weight 1, bias 0."""
        for module in self.modules():
            if isinstance(module, nn.Conv3d):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, KerasInstanceNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 5:
            raise ModelInputError(f"model input must be (B, C, D, H, W), got shape {tuple(x.shape)}")
        if x.shape[1] != self.in_channels:
            raise ModelInputError(
                f"model input has {x.shape[1]} channels but model.in_channels is {self.in_channels}")
        spatial = tuple(x.shape[2:])
        if any(size % self.size_divisor for size in spatial):
            raise ModelInputError(
                f"model input spatial size {spatial} must be divisible by {self.size_divisor} "
                f"(2**(model.depth-1) with depth {self.depth}); change data.cube or train.patch")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)

        # Contracting path; each level's residual sum is kept as its skip connection.
        skips: list[torch.Tensor] = []
        for level in range(self.depth):
            x = self.encoder[f"level{level}"](x)
            skips.append(x)

        # Expanding path with deep supervision: the segmentation maps of the lowest `segmentation_levels`
        # levels are summed coarse to fine, upsampling the running sum before each addition (Ellis's order).
        summed_seg = None
        for level in reversed(range(self.depth - 1)):
            decoder_level = self.decoder[f"level{level}"]
            x = decoder_level(x, skips[level])
            if decoder_level.segmentation is not None:
                seg = decoder_level.segmentation(x)
                if summed_seg is None:
                    summed_seg = seg
                else:
                    summed_seg = F.interpolate(summed_seg, scale_factor=2, mode="nearest") + seg
        return torch.sigmoid(summed_seg)


def _validate_config(cfg: ModelConfig, out_channels: int) -> None:
    if cfg.depth < 2:
        raise ConfigError(f"model.depth must be at least 2, got {cfg.depth}")
    if not 1 <= cfg.segmentation_levels <= cfg.depth - 1:
        raise ConfigError(
            f"model.segmentation_levels must be between 1 and model.depth-1 = {cfg.depth - 1}, "
            f"got {cfg.segmentation_levels}")
    if cfg.base_filters < 1 or cfg.in_channels < 1 or out_channels < 1:
        raise ConfigError(
            f"model.base_filters, model.in_channels and the output channels must be positive, got "
            f"{cfg.base_filters}, {cfg.in_channels}, {out_channels}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {cfg.dropout}")
    if cfg.seg_layer not in ("norm_act", "conv"):
        raise ConfigError(f"model.seg_layer must be 'norm_act' or 'conv', got {cfg.seg_layer!r}")
    if cfg.norm_eps <= 0:
        raise ConfigError(f"model.norm_eps must be positive, got {cfg.norm_eps}")


def block_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's levels in forward order: ("encoder.level0", ...), ..., ("decoder.level0", ...).

    The memory engine uses these as block markers (reload a swapped tensor N blocks before it is needed).
    Names are the modules' qualified names in `model.named_modules()`.
    """
    blocks = [(f"encoder.{name}", module) for name, module in model.encoder.items()]
    blocks += [(f"decoder.{name}", module) for name, module in model.decoder.items()]
    return blocks
