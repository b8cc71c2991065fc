"""A zoo of third-party model shapes (issue 41), written out: neither torchvision nor timm installs
here (torchvision's wheel for this torch is a CUDA build that does not import). Each keeps its
library's module tree, ops, in-place writes and random layers, at tiny widths and depths:

  resnet        torchvision/models/resnet.py: BasicBlock, BatchNorm, ReLU(inplace=True), out += identity
  mobilenet_v3  torchvision/models/mobilenetv3.py, ops/misc.py: InvertedResidual, SqueezeExcitation,
                Hardswish, BatchNorm(eps 1e-3), a head with nn.Dropout(p=0.2, inplace=True)
  convnext      torchvision/models/convnext.py: CNBlock (depthwise 7x7, Permute, LayerNorm, layer scale),
                LayerNorm2d, StochasticDepth "row" rising to 0.1
  efficientnet  torchvision/models/efficientnet.py: MBConv (SiLU, SE, StochasticDepth "row" rising to
                0.2, result += input), nn.Dropout(p=0.2, inplace=True) head
  vit           timm/models/vision_transformer.py: patch embedding, cls token, Attention (fused sdpa with
                attention dropout), Mlp, DropPath rising to 0.1, dropout 0.1
  nanogpt       karpathy/nanoGPT model.py (tied head, loss inside forward, dropout 0.1) with timm's
                DropPath 0.1 on each residual branch, the way people add it

The random layers: timm/layers/drop.py ``drop_path`` (``x.new_empty(shape).bernoulli_``) and
torchvision/ops/stochastic_depth.py (``torch.empty(size).bernoulli_``). The ranks load this file by
its path for ``gpt_batch`` (Workload.source), so it imports only torch; tests/e2e/test_zoo.py
builds the workloads."""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.abspath(__file__)
IMAGE, CLASSES, VOCAB, SEQ = 32, 10, 64, 16


# ---- timm/layers/drop.py and torchvision/ops/stochastic_depth.py ---------------------------------
def drop_path(x, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True):
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class DropPath(nn.Module):
    def __init__(self, drop_prob: float = 0.0, scale_by_keep: bool = True):
        super().__init__()
        self.drop_prob, self.scale_by_keep = drop_prob, scale_by_keep

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training, self.scale_by_keep)


def stochastic_depth(x, p: float, mode: str, training: bool = True):
    if not training or p == 0.0:
        return x
    survival_rate = 1.0 - p
    size = [x.shape[0]] + [1] * (x.ndim - 1) if mode == "row" else [1] * x.ndim
    noise = torch.empty(size, dtype=x.dtype, device=x.device)
    noise = noise.bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return x * noise


class StochasticDepth(nn.Module):
    def __init__(self, p: float, mode: str):
        super().__init__()
        self.p, self.mode = p, mode

    def forward(self, x):
        return stochastic_depth(x, self.p, self.mode, self.training)


# ---- torchvision/ops/misc.py ---------------------------------------------------------------------
class Conv2dNormActivation(nn.Sequential):
    def __init__(self, cin, cout, kernel_size=3, stride=1, padding=None, groups=1, norm_layer=nn.BatchNorm2d,
                 activation_layer=nn.ReLU, bias=None):
        padding = (kernel_size - 1) // 2 if padding is None else padding
        layers = [nn.Conv2d(cin, cout, kernel_size, stride, padding, groups=groups,
                            bias=norm_layer is None if bias is None else bias)]
        if norm_layer is not None:
            layers.append(norm_layer(cout))
        if activation_layer is not None:
            layers.append(activation_layer(inplace=True))
        super().__init__(*layers)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels, squeeze, activation=nn.ReLU, scale_activation=nn.Sigmoid):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(channels, squeeze, 1), nn.Conv2d(squeeze, channels, 1)
        self.activation, self.scale_activation = activation(), scale_activation()

    def forward(self, x):
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class Permute(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return torch.permute(x, self.dims)


def make_divisible(v, divisor=8):
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


# ---- torchvision/models/resnet.py ----------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, layers=(1, 1, 1, 1), widths=(4, 8, 8, 16), num_classes=CLASSES):
        super().__init__()
        self.inplanes = widths[0]
        self.conv1 = nn.Conv2d(3, self.inplanes, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1, self.layer2, self.layer3, self.layer4 = (
            self._make_layer(w, n, 1 if i == 0 else 2) for i, (w, n) in enumerate(zip(widths, layers)))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[-1], num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, planes, blocks, stride):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# ---- torchvision/models/mobilenetv3.py -----------------------------------------------------------
class InvertedResidual(nn.Module):
    def __init__(self, cin, kernel, expanded, cout, use_se, activation, stride, norm_layer):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        act = nn.Hardswish if activation == "HS" else nn.ReLU
        layers = []
        if expanded != cin:
            layers.append(Conv2dNormActivation(cin, expanded, 1, norm_layer=norm_layer, activation_layer=act))
        layers.append(Conv2dNormActivation(expanded, expanded, kernel, stride, groups=expanded, norm_layer=norm_layer,
                                           activation_layer=act))
        if use_se:
            layers.append(SqueezeExcitation(expanded, make_divisible(expanded // 4), scale_activation=nn.Hardsigmoid))
        layers.append(Conv2dNormActivation(expanded, cout, 1, norm_layer=norm_layer, activation_layer=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        result = self.block(x)
        if self.use_res_connect:
            result += x
        return result


# (input, kernel, expanded, out, use_se, activation, stride): mobilenet_v3_small's first rows, narrowed
MOBILENET_SETTING = [(8, 3, 8, 8, True, "RE", 2), (8, 3, 24, 16, False, "RE", 2), (16, 3, 32, 16, False, "RE", 1),
                     (16, 5, 48, 24, True, "HS", 2), (24, 5, 48, 24, True, "HS", 1)]


class MobileNetV3(nn.Module):
    def __init__(self, setting=MOBILENET_SETTING, last_channel=64, num_classes=CLASSES, dropout=0.2):
        super().__init__()
        norm_layer = functools.partial(nn.BatchNorm2d, eps=0.001, momentum=0.01)
        layers = [Conv2dNormActivation(3, setting[0][0], 3, 2, norm_layer=norm_layer, activation_layer=nn.Hardswish)]
        layers += [InvertedResidual(*row, norm_layer=norm_layer) for row in setting]
        lastconv = 6 * setting[-1][3]
        layers.append(Conv2dNormActivation(setting[-1][3], lastconv, 1, norm_layer=norm_layer,
                                           activation_layer=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(lastconv, last_channel), nn.Hardswish(inplace=True),
                                        nn.Dropout(p=dropout, inplace=True), nn.Linear(last_channel, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# ---- torchvision/models/convnext.py --------------------------------------------------------------
class LayerNorm2d(nn.LayerNorm):
    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class CNBlock(nn.Module):
    def __init__(self, dim, layer_scale, stochastic_depth_prob):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(dim, dim, 7, padding=3, groups=dim), Permute([0, 2, 3, 1]),
                                   nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, 4 * dim), nn.GELU(),
                                   nn.Linear(4 * dim, dim), Permute([0, 3, 1, 2]))
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)
        self.stochastic_depth = StochasticDepth(stochastic_depth_prob, "row")

    def forward(self, x):
        result = self.stochastic_depth(self.layer_scale * self.block(x))
        result += x
        return result


class ConvNeXt(nn.Module):
    def __init__(self, block_setting=((8, 16, 2), (16, None, 2)), stochastic_depth_prob=0.1, layer_scale=1e-6,
                 num_classes=CLASSES):
        super().__init__()
        norm_layer = functools.partial(LayerNorm2d, eps=1e-6)
        layers = [Conv2dNormActivation(3, block_setting[0][0], 4, 4, padding=0, norm_layer=norm_layer,
                                       activation_layer=None, bias=True)]
        total, block_id = sum(n for _, _, n in block_setting), 0
        for cin, cout, n in block_setting:
            stage = []
            for _ in range(n):
                stage.append(CNBlock(cin, layer_scale, stochastic_depth_prob * block_id / (total - 1.0)))
                block_id += 1
            layers.append(nn.Sequential(*stage))
            if cout is not None:
                layers.append(nn.Sequential(norm_layer(cin), nn.Conv2d(cin, cout, 2, 2)))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        last = block_setting[-1][1] or block_setting[-1][0]
        self.classifier = nn.Sequential(norm_layer(last), nn.Flatten(1), nn.Linear(last, num_classes))
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.classifier(self.avgpool(self.features(x)))


# ---- torchvision/models/efficientnet.py ----------------------------------------------------------
class MBConv(nn.Module):
    def __init__(self, expand_ratio, kernel, stride, cin, cout, stochastic_depth_prob, norm_layer):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        expanded = make_divisible(cin * expand_ratio)
        layers = []
        if expanded != cin:
            layers.append(Conv2dNormActivation(cin, expanded, 1, norm_layer=norm_layer, activation_layer=nn.SiLU))
        layers.append(Conv2dNormActivation(expanded, expanded, kernel, stride, groups=expanded, norm_layer=norm_layer,
                                           activation_layer=nn.SiLU))
        layers.append(SqueezeExcitation(expanded, max(1, cin // 4),
                                        activation=functools.partial(nn.SiLU, inplace=True)))
        layers.append(Conv2dNormActivation(expanded, cout, 1, norm_layer=norm_layer, activation_layer=None))
        self.block = nn.Sequential(*layers)
        self.stochastic_depth = StochasticDepth(stochastic_depth_prob, "row")

    def forward(self, x):
        result = self.block(x)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += x
        return result


# (expand_ratio, kernel, stride, input, out, layers): efficientnet_b0's first rows, narrowed
EFFICIENTNET_SETTING = [(1, 3, 1, 16, 8, 1), (6, 3, 2, 8, 16, 2), (6, 5, 2, 16, 24, 2)]


class EfficientNet(nn.Module):
    def __init__(self, setting=EFFICIENTNET_SETTING, dropout=0.2, stochastic_depth_prob=0.2, num_classes=CLASSES):
        super().__init__()
        norm_layer = nn.BatchNorm2d
        layers = [Conv2dNormActivation(3, setting[0][3], 3, 2, norm_layer=norm_layer, activation_layer=nn.SiLU)]
        total, block_id = sum(row[5] for row in setting), 0
        for expand, kernel, stride, cin, cout, n in setting:
            stage = []
            for i in range(n):
                stage.append(MBConv(expand, kernel, stride if i == 0 else 1, cin if i == 0 else cout, cout,
                                    stochastic_depth_prob * float(block_id) / total, norm_layer))
                block_id += 1
            layers.append(nn.Sequential(*stage))
        last = 4 * setting[-1][4]
        layers.append(Conv2dNormActivation(setting[-1][4], last, 1, norm_layer=norm_layer, activation_layer=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout, inplace=True), nn.Linear(last, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.Linear):
                nn.init.uniform_(m.weight, -1.0 / math.sqrt(m.out_features), 1.0 / math.sqrt(m.out_features))
                nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# ---- timm/models/vision_transformer.py -----------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, dim, num_heads, qkv_bias=True, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj, self.proj_drop = nn.Linear(dim, dim), nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))


class Mlp(nn.Module):
    def __init__(self, dim, hidden, drop=0.0):
        super().__init__()
        self.fc1, self.act, self.drop1 = nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(drop)
        self.norm, self.fc2, self.drop2 = nn.Identity(), nn.Linear(hidden, dim), nn.Dropout(drop)

    def forward(self, x):
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class ViTBlock(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, proj_drop=0.0, attn_drop=0.0, drop_path=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, attn_drop=attn_drop, proj_drop=proj_drop)
        self.ls1, self.drop_path1 = nn.Identity(), DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=proj_drop)
        self.ls2, self.drop_path2 = nn.Identity(), DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x):
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class VisionTransformer(nn.Module):
    def __init__(self, img_size=IMAGE, patch_size=8, embed_dim=16, depth=3, num_heads=2, num_classes=CLASSES,
                 drop_rate=0.1, attn_drop_rate=0.1, drop_path_rate=0.1):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, embed_dim, patch_size, patch_size)  # PatchEmbed.proj
        patches = (img_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, patches + 1, embed_dim) * 0.02)
        self.pos_drop = nn.Dropout(drop_rate)
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.Sequential(*(ViTBlock(embed_dim, num_heads, proj_drop=drop_rate, attn_drop=attn_drop_rate,
                                               drop_path=dpr[i]) for i in range(depth)))
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.fc_norm, self.head_drop = nn.Identity(), nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.norm(self.blocks(self.pos_drop(x + self.pos_embed)))
        return self.head(self.head_drop(self.fc_norm(x[:, 0])))


# ---- karpathy/nanoGPT model.py, with drop path ---------------------------------------------------
class LayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, dropout, bias):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd, bias=bias), nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout, self.resid_dropout = nn.Dropout(dropout), nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd, dropout, bias):
        super().__init__()
        self.c_fc, self.gelu = nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.GELU()
        self.c_proj, self.dropout = nn.Linear(4 * n_embd, n_embd, bias=bias), nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, n_embd, n_head, dropout, bias, drop_path):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(n_embd, bias), CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2, self.mlp = LayerNorm(n_embd, bias), MLP(n_embd, dropout, bias)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.ln_1(x)))
        return x + self.drop_path(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self, block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=16, dropout=0.1, bias=True,
                 drop_path=0.1):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd), drop=nn.Dropout(dropout),
            h=nn.ModuleList([GPTBlock(n_embd, n_head, dropout, bias, drop_path) for _ in range(n_layer)]),
            ln_f=LayerNorm(n_embd, bias)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits, loss = self.lm_head(x[:, [-1], :]), None
        return logits, loss


# ---- nanoGPT's data and loss: its forward computes the loss -------------------------------------
def gpt_batch(step: int, batch_size: int, *, seed: int = 0):
    """nanoGPT's get_batch on synthetic tokens: the model takes (idx, targets) and returns its loss."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=gen)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    return (x, y), y


def own_loss(output, target):
    return output[1]  # nanoGPT's forward returns (logits, loss)
