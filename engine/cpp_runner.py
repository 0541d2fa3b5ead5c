"""graph_mode=cpp: a decode-only step's decoder layers in one call of the C++ decode runner.

The runner (kernels/cpu/csrc/runner.cpp, `DecodeRunner`) holds every layer's weights, handed over
once here at load, and runs every layer's attention — DeepSeek's absorbed MLA (q/kv projections,
norms, RoPE, head_linear, mla_decode with the fused cache write, o_proj), or the GQA families'
(Qwen3-MoE, Qwen2-MoE, Llama: q/k/v projections with biases or per-head q/k norms, RoPE, the K/V
rows written, paged_decode, o_proj) — and the MoE (router, grouped top-k, fused MoE, shared experts,
Qwen2-MoE's shared gate) or dense FFN, calling the kernels directly; it also embeds the tokens and computes the rotary
angles, and (`step_logits`, what LLM._step calls) lm_head. Python keeps the step's cache metadata:
the sequences' block tables, handed over as lists.

Per-call knobs: each call site's SitePlan (engine/kernel_tables.py, through TunedOps) chooses its
struct by the step's bucket exactly as on the eager path; the chosen structs are registered with the
runner once per distinct bucket (tokens, and the mla_decode context bucket) and named by an integer,
so a step hands over no structs. Inside kernels.cpu.recording() the runner reports its calls (op,
format, tokens, the struct it used, the ISA variants) into the recording, as the eager wrappers do.
"""
from __future__ import annotations

import torch

_HOST = torch.device("cpu")


def unsupported(model) -> str | None:
    """Why the runner cannot run this model (None: it can)."""
    from kernels import cpu

    c = model.cfg
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {model.dtype} (the runner takes float32 and bfloat16)"
    if c.scoring_func not in ("sigmoid", "softmax"):
        return f"scoring function {c.scoring_func!r}"
    if not c.is_mla and c.rope_interleave:
        return "interleaved rope on a GQA model"
    w = model.w
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        if c.is_mla:
            names = [p + "kv_a_proj", p + "o_proj"] + ([p + "q_proj"] if c.q_lora_rank is None else
                                                        [p + "q_a_proj", p + "q_b_proj"])
        else:
            names = [p + "q_proj", p + "k_proj", p + "v_proj", p + "o_proj"]
        if c.is_moe_layer(i):
            if c.n_routed_experts % max(c.n_group, 1):
                return "experts not divisible into groups"
            a13, a2 = w[p + "experts.w13"], w[p + "experts.w2"]
            if not (isinstance(a13, cpu.Packed) and isinstance(a2, cpu.Packed) and cpu.moe_formats_match(a13.args[0], a2.args[0])
                    and a13.args[6:] == a2.args[6:] and a13.args[1].dim() == 3):
                return f"layer {i}'s experts are in a format the fused MoE kernel does not take"
            if not isinstance(model.routers[i], cpu.Packed):
                return f"layer {i}'s router is not a kernel weight"
            if c.shared_width:
                names += [p + "shared.gate_up", p + "shared.down"]
            gates = getattr(model, "shared_gates", {})
            if i in gates and not isinstance(gates[i], cpu.Packed):
                return f"layer {i}'s shared expert gate is not a kernel weight"
        else:
            names += [p + "mlp.gate_up", p + "mlp.down"]
        for n in names:
            if not isinstance(w[n], cpu.Packed) or w[n].args[1].dim() != 2:
                return f"{n} is in a format the linear kernel does not take"
    return None


def _tensors(cache) -> list[torch.Tensor]:
    """The cache as the runner takes it: [the latent cache] (MLA) or [k, v] (GQA)."""
    return [cache.k, cache.v] if hasattr(cache, "k") else [cache.layers]


def _layer_weights(model, i: int) -> tuple[dict, dict]:
    """Layer i's weights by knob slot (the call sites; RUNNER_SLOTS names) and its other tensors."""
    c, w, p = model.cfg, model.w, f"layers.{i}."
    if c.is_mla:
        by_slot = {"q_b": w[p + ("q_proj" if c.q_lora_rank is None else "q_b_proj")],
                   "kv_a": w[p + "kv_a_proj"], "o": w[p + "o_proj"]}
        if c.q_lora_rank is not None:
            by_slot["q_a"] = w[p + "q_a_proj"]
        ten = {"q_a_norm": w.get(p + "q_a_norm"), "kv_a_norm": w[p + "kv_a_norm"],
               "w_uk": model.w_uk[i], "w_uv": model.w_uv[i]}
    else:
        by_slot = {s: w[p + s + "_proj"] for s in ("q", "k", "v", "o")}
        ten = {n: w.get(p + n) for n in ("q_norm", "k_norm", "q_bias", "k_bias", "v_bias")}
    if c.is_moe_layer(i):
        by_slot.update(ffn1=w[p + "experts.w13"], w2=w[p + "experts.w2"], router=model.routers[i])
        if c.shared_width:
            by_slot.update(shared_gate_up=w[p + "shared.gate_up"], shared_down=w[p + "shared.down"])
        if i in getattr(model, "shared_gates", {}):  # Qwen2-MoE: the shared expert's sigmoid gate
            by_slot["shared_gate"] = model.shared_gates[i]
    else:
        by_slot.update(ffn1=w[p + "mlp.gate_up"], down=w[p + "mlp.down"])
    next_norm = w[f"layers.{i + 1}.attn_norm"] if i + 1 < c.num_hidden_layers else w["norm"]
    ten.update(attn_norm=w[p + "attn_norm"], ffn_norm=w[p + "ffn_norm"], next_norm=next_norm,
               bias=w.get(p + "router_bias"))
    return by_slot, ten


# runner.cpp's names of the weights (Layer's fields) by knob slot
_CXX = {"q_b": "q_b", "kv_a": "kv_a", "o": "o", "q_a": "q_a", "router": "router", "shared_gate_up": "sh_gu",
        "shared_down": "sh_down", "down": "down", "w2": "w2", "q": "q", "k": "k", "v": "v", "shared_gate": "sh_gate"}


class CppDecodeRunner:
    """The C++ runner of one loaded model; `forward(batch, cache)` as the model's forward for decode steps."""

    def __init__(self, model, ops, knobs: dict):
        from kernels import cpu

        self._cpu, self.model, self.ops = cpu, model, ops
        c = model.cfg
        ext = cpu.extension()
        self.slots = tuple(ext.RUNNER_SLOTS)
        mla = c.is_mla
        self.runner = ext.DecodeRunner(
            heads=c.num_attention_heads, qk_nope=c.qk_nope_head_dim if mla else 0, qk_rope=c.qk_rope_head_dim,
            kv_lora_rank=c.kv_lora_rank if mla else 0, v_head=c.v_head_dim if mla else c.head_dim,
            hidden=c.hidden_size, eps=c.rms_norm_eps,
            scale=model.scale, interleave=c.rope_interleave, topk=c.num_experts_per_tok, n_group=c.n_group,
            topk_group=c.topk_group, sigmoid=c.scoring_func == "sigmoid", renormalize=c.norm_topk_prob,
            scaling=c.routed_scaling_factor, bf16=model.dtype == torch.bfloat16,
            serial_below=knobs["cpu_serial_below_bytes"])
        if not mla:
            self.runner.set_gqa(kv_heads=c.num_key_value_heads, head_dim=c.head_dim)
        w = model.w
        self.layer_weights: list[dict] = []  # per layer: slot → the weight object (its call site; bytes)
        for i in range(c.num_hidden_layers):
            moe = c.is_moe_layer(i)
            by_slot, ten = _layer_weights(model, i)
            self.layer_weights.append(by_slot)
            lin = {_CXX[s]: wt.args for s, wt in by_slot.items() if s in _CXX}
            lin["w13" if moe else "gu"] = by_slot["ffn1"].args
            self.runner.add_layer(lin, ten, moe)
        self.runner.set_embedding(w["embed"], model.rotary.inv_freq, model.rotary.factor)
        self.lm_head = w["lm_head"]
        self.has_lm_head = isinstance(self.lm_head, cpu.Packed) and self.lm_head.args[1].dim() == 2
        if self.has_lm_head:  # else `logits` is unavailable and the step runs lm_head in Python
            self.runner.set_lm_head(self.lm_head.args)
        self._keys: dict[tuple, int] = {}
        self._structs: dict[int, list] = {}
        self._default = cpu.make_knobs()
        self._records = False  # what the runner was last told of recording
        self._attn_site = model.attention_sites()[0]  # the decode attention call site (op, shape key)
        self._attention_choice = getattr(ops, "attention_choice", None)  # TunedOps: the per-call tables
        self._cache_fmt = "bf16" if model.dtype == torch.bfloat16 else "f32"

    # ------------------------------------------------------------ knobs per bucket

    def _choice(self, weight, tokens: int):
        choice = getattr(self.ops, "weight_choice", None)  # TunedOps: the per-call tables
        return choice(weight, tokens) if choice is not None else None

    def _attn_choice(self, tokens: int, context: int):
        """The decode attention site's choice (mla_decode, or paged_decode for the GQA families)."""
        if self._attention_choice is None:
            return None
        op, key = self._attn_site
        return self._attention_choice(op, key, tokens, context)

    def _struct(self, choice):
        """A choice's knob struct (its prebuilt one, or one built from its overrides; None: the defaults)."""
        arg = choice.arg if choice is not None else None
        return arg if isinstance(arg, self._cpu._ext.Knobs) else self._cpu.make_knobs(arg)

    def _key(self, tokens: int, context: int) -> int:
        attn = self._attn_choice(tokens, context)
        k = (tokens, id(attn))
        key = self._keys.get(k)
        if key is None:
            key = self._keys[k] = len(self._keys)
            structs = [[self._struct(attn if s == "attn" else self._choice(by_slot[s], tokens) if s in by_slot else None)
                        for s in self.slots] for by_slot in self.layer_weights]
            head = self._choice(self.lm_head, tokens) if self.has_lm_head else None
            structs.append([self._struct(head)] * len(self.slots))
            self.runner.set_knobs(key, structs)
            self._structs[key] = structs
        return key

    # ------------------------------------------------------------ the step

    def forward(self, batch, cache) -> torch.Tensor:
        """Hidden states after the final norm [T, D] for a decode-only batch (one token per sequence)."""
        return self._run(self.runner.forward, batch, cache)

    def step_logits(self, ids: list[int], positions: list[int], tables: list[list[int]], cache) -> torch.Tensor:
        """The float32 logits [B, vocab] of a decode step, lm_head included (has_lm_head), from plain
        lists (what LLM._step calls: no Batch and no tensors built in Python): each sequence's new
        token, its position and its block table (cache space for the token reserved)."""
        return self._call(self.runner.step_logits, self._key(len(ids), max(positions) + 1),
                          ids, positions, tables, _tensors(cache))

    def _run(self, fn, batch, cache) -> torch.Tensor:
        tables, lens = batch.decode_rows(_HOST)
        return self._call(fn, self._key(lens.shape[0], int(lens.max())),
                          batch.token_ids, batch.positions, _tensors(cache), tables, lens, batch.slots)

    def _call(self, fn, key: int, *args) -> torch.Tensor:
        """fn(*args, key) on the runner, its calls replayed into kernels.cpu.recording() when one is
        open (the runner is told of recording only when that changes)."""
        on = self._cpu.is_recording()
        if on != self._records:
            self.runner.recording = self._records = on
        out = fn(*args, key)
        if on:
            self._replay(key)
        return out

    def _replay(self, key: int) -> None:
        names = self._cpu.FORMAT_NAMES
        structs = self._structs[key]
        for op, fmt, tokens, layer, slot, isa in self.runner.calls:
            self._cpu.record_call(op, names[fmt] if fmt >= 0 else self._cache_fmt, tokens, structs[layer][slot], isa)
