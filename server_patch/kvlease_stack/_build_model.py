"""Build a deterministic local model for the kvlease stack (runs inside the vLLM venv).

Usage: ``python _build_model.py SPEC_JSON OUT_DIR``. ``SPEC_JSON`` is the JSON of a model spec
(see ``_model.MODEL_SPECS``). Nothing is downloaded: the byte-level BPE tokenizer is trained on the
interpreter's own standard-library sources, the weights (``arch``: ``qwen2``, the default, or
``gemma3``: Gemma-3 text layers, sliding-window and global attention per ``layer_types``) are drawn
from a fixed seed and, when ``train_steps`` > 0, trained briefly on the same text so that greedy
output depends on the prompt. The script verifies that property (and, with
``verify_long_range``, that the global layers carry tokens from further back than the
sliding-window layers reach) and exits non-zero if it does not hold.

This file imports torch/transformers: it is executed by the vLLM venv's interpreter, never imported
by the project.
"""

from __future__ import annotations

import json
import os
import random
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def log(msg: str) -> None:
    print(f"[model] {msg}", flush=True)


def corpus_files(max_bytes: int) -> list[Path]:
    """Sorted standard-library sources (tests excluded) up to ``max_bytes``: deterministic."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if (
            rel[0] in {"test", "site-packages", "idlelib", "lib2to3", "tkinter", "turtledemo"}
            or "tests" in rel
        ):
            continue
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if size == 0 or size > 400_000:
            continue
        files.append(path)
        total += size
        if total >= max_bytes:
            break
    return files


def read_texts(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def training_ids(texts: list[str], tok: Any, seq: int) -> list[list[int]]:
    """Windows of ``seq + 1`` tokens: half plain source, half ChatML (user: code, assistant: next code)."""
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    nl = tok.encode("\n").ids
    user, assistant = tok.encode("user").ids, tok.encode("assistant").ids
    stream: list[int] = []
    for text in texts:
        stream.extend(tok.encode(text).ids)
    windows: list[list[int]] = []
    rng = random.Random(1234)
    pos = 0
    while pos + 2 * seq < len(stream):
        if rng.random() < 0.5:
            windows.append(stream[pos : pos + seq + 1])
            pos += seq
        else:
            cut = rng.randint(seq // 8, seq // 2)
            head = [im_start, *user, *nl, *stream[pos : pos + cut], im_end, *nl, im_start, *assistant, *nl]
            body = stream[pos + cut : pos + cut + seq + 1 - len(head)]
            windows.append((head + body)[: seq + 1])
            pos += cut + len(body)
    return windows


def make_model(spec: dict[str, Any], *, vocab_size: int, eos_id: int, pad_id: int) -> Any:
    """The untrained causal LM of ``spec`` (weights from the seeded global RNG)."""
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": int(spec["hidden_size"]),
        "intermediate_size": int(spec["intermediate_size"]),
        "num_hidden_layers": int(spec["num_layers"]),
        "num_attention_heads": int(spec["num_heads"]),
        "num_key_value_heads": int(spec["num_kv_heads"]),
        "max_position_embeddings": int(spec["max_position_embeddings"]),
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }
    arch = spec.get("arch", "qwen2")
    if arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        head_dim = int(spec["hidden_size"]) // int(spec["num_heads"])
        layer_types = list(spec["layer_types"])
        if len(layer_types) != int(spec["num_layers"]):
            raise SystemExit(
                f"layer_types names {len(layer_types)} layers, num_layers is {spec['num_layers']}"
            )
        config = Gemma3TextConfig(
            **common,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=int(spec["sliding_window"]),
            layer_types=layer_types,
        )
        return Gemma3ForCausalLM(config)
    if arch != "qwen2":
        raise SystemExit(f"unknown arch {arch!r}")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **common,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=int(spec["num_layers"]),
    )
    return Qwen2ForCausalLM(config)


def build(spec: dict[str, Any], out: Path) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast

    seed = int(spec["seed"])
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(threads)
    random.seed(seed)
    torch.manual_seed(seed)

    t0 = time.monotonic()
    texts = read_texts(corpus_files(int(spec["corpus_bytes"])))
    tok = train_tokenizer(texts, int(spec["vocab_size"]))
    log(
        f"tokenizer: vocab {tok.get_vocab_size()} from {sum(map(len, texts)) / 1e6:.1f} MB "
        f"in {time.monotonic() - t0:.1f} s"
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=int(spec["max_position_embeddings"]),
    )
    eos_id = tok.token_to_id("<|im_end|>")
    pad_id = tok.token_to_id("<|endoftext|>")

    model = make_model(spec, vocab_size=tok.get_vocab_size(), eos_id=eos_id, pad_id=pad_id)
    model.train()

    steps, seq, batch = int(spec["train_steps"]), int(spec["train_seq"]), int(spec["train_batch"])
    if steps > 0:
        windows = training_ids(texts, tok, seq)
        log(f"training: {steps} steps, batch {batch}, seq {seq}, {len(windows)} windows, {threads} threads")
        opt = torch.optim.AdamW(model.parameters(), lr=float(spec["lr"]), weight_decay=0.01)
        rng = random.Random(seed)
        t1 = time.monotonic()
        for step in range(1, steps + 1):
            lr = float(spec["lr"]) * min(1.0, step / 20) * (0.1 + 0.9 * (1 - step / steps))
            for group in opt.param_groups:
                group["lr"] = lr
            ids = torch.tensor([windows[rng.randrange(len(windows))] for _ in range(batch)])
            # The model shifts the labels itself (token t predicts t + 1).
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step == 1 or step % 10 == 0 or step == steps:
                el = time.monotonic() - t1
                log(
                    f"step {step}/{steps} loss {loss.item():.3f} ({el:.0f} s, eta {el / step * (steps - step):.0f} s)"
                )
    model.eval()
    model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    # Keep the chat template in tokenizer_config.json as well (older readers look only there).
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["eos_token"] = "<|im_end|>"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    log(f"saved to {out} in {time.monotonic() - t0:.1f} s")

    if spec.get("verify_prompt_dependence"):
        verify(out)
    if spec.get("verify_long_range"):
        verify_long_range(out, spec)


def verify(out: Path) -> None:
    """Greedy output must depend on the prompt (else KV-correctness tests would prove nothing)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    model.eval()
    prompts = [
        "def fibonacci(n):\n    ",
        "import os\nclass Config:\n    def __init__(self, path):",
        "Explain what a socket is.",
        "for key, value in sorted(items.items()):",
    ]
    outputs = []
    for p in prompts:
        text = tok.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=16, do_sample=False)
        outputs.append(tuple(gen[0, ids.shape[1] :].tolist()))
        log(f"verify: {p[:30]!r} -> {tok.decode(outputs[-1])[:60]!r}")
    distinct = len(set(outputs))
    if outputs[0] == outputs[1] or distinct < 3:
        raise SystemExit(
            f"model check failed: greedy output does not depend on the prompt ({distinct} distinct of 4)"
        )
    log(f"verify: {distinct} distinct greedy outputs of {len(prompts)} prompts")


def verify_long_range(out: Path, spec: dict[str, Any]) -> None:
    """The global layers must carry tokens further back than the sliding-window layers reach together:
    prompts that differ only in their first token, followed by the same long text, must give
    different next-token logits (through sliding-window layers alone they would be bit-identical).
    Whether the greedy continuations differ as well is only logged: a briefly trained model rarely
    leans on that far a context hard enough to change its greedy choice."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.eval()
    sliding = sum(t == "sliding_attention" for t in spec["layer_types"])
    reach = sliding * int(spec["sliding_window"])  # positions the sliding-window layers alone bridge
    filler = "".join(
        f"Step {i}: the loader reads entry number {i}, checks its type, applies the default value and "
        "stores it in the cache before moving on. "
        for i in range(1, 2 + reach // 20)
    )
    text = tok.apply_chat_template(
        [{"role": "user", "content": "x " + filler}], tokenize=False, add_generation_prompt=True
    )
    base = tok(text).input_ids
    first = len(tok("<|im_start|>user\n").input_ids)  # the first token of the user's text
    if len(base) - 1 - first <= reach:
        raise SystemExit(f"long-range check: the first token is only {len(base) - 1 - first} positions back")
    logits, greedy = [], set()
    for word in ("def", "import", "class", "return"):
        ids = torch.tensor([[*base[:first], tok(word).input_ids[0], *base[first + 1 :]]])
        with torch.no_grad():
            logits.append(model(ids).logits[0, -1])
            gen = model.generate(ids, max_new_tokens=16, do_sample=False)
        greedy.add(tuple(gen[0, ids.shape[1] :].tolist()))
    same = sum(torch.equal(logits[i], logits[j]) for i in range(4) for j in range(i + 1, 4))
    if same:
        raise SystemExit(
            f"model check failed: output does not depend on tokens more than {reach} positions back "
            f"({same} of 6 pairs of first tokens give identical logits)"
        )
    spread = max(float((logits[0] - x).abs().max()) for x in logits[1:])
    log(
        f"verify long range: the first token, {len(base) - 1 - first} positions back (> {reach}), changes "
        f"the logits (by up to {spread:.3g}); {len(greedy)} distinct greedy outputs of 4"
    )


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    spec = json.loads(argv[1])
    out = Path(argv[2])
    out.mkdir(parents=True, exist_ok=True)
    build(spec, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
