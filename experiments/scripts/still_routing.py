"""Where STILL's routing variants leave a needle (passkey, niah_single), replayed on a model's q and k (CPU will do).

    python -m experiments.scripts.still_routing [--model smollm2] [--lengths 1k,2k,4k,8k] [--depths 0,25,50,75,100]
                                               [--task passkey | --task niah_single [--variant 1|2|3]]
                                               [--configs 0,2] [--parts routing,mass] [--out DIR]

For each prompt of the task (passkey by default; the evaluation's first sample at each depth) and
each routing variant below (`--configs`: their indices, all by default): the share of (prompt,
layer, KV head) triples whose softmax set still holds one whole copy of the key at the question,
and what became of the key's tokens (`experiments.routing`). On the teacher (the default) this isolates the routing: a trained row's q and k differ from it by stage 2's
LoRA and, past layer 0, by the student's own hidden states; pass its directory to see its own.
Writes routing.json, routing.md and routing.png to --out.

The `mass` part asks the next question, on the model as it is (a STILL model's own routing and
feature maps, a Lizard model's gates and window, a teacher's softmax): at the question, how much of
each head's normaliser goes to the key, and how much the linear terms take
(`experiments.routing.needle_mass`). Writes mass.json, mass.md, mass.png. On Lizard, pass
`--parts mass` (the routing replay is STILL's).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from matplotlib.figure import Figure

from experiments.routing import EVICTED, LEFT_WINDOW, MASS_SHARES, VISIBLE, needle_mass, needle_routing
from linearize.cli_args import compact_json
from linearize.config import StillConfig
from linearize.eval.api import parse_depths, parse_lengths
from linearize.eval.report import length_label
from linearize.figures import save_png
from linearize.loading import load_model, load_tokenizer

VARIANTS = {
    "saliency, budget 896 (ours: capped)": StillConfig(),
    "saliency, budget 1536": StillConfig(budget=1536),
    "saliency, uncapped (published)": StillConfig(budget=32768, max_chunks=680),
    # The paper's lambda = (m - W) / T_max with T_max sized for the context instead of training's 1K:
    # the same 768 slots, fewer picks a chunk, so they fill later (at T_max chunks).
    "saliency, budget 896, T_max 32": StillConfig(max_chunks=32),
    "saliency, budget 896, T_max 64": StillConfig(max_chunks=64),
    "saliency, budget 896, T_max 128": StillConfig(max_chunks=128),
    "random, budget 896": StillConfig(routing="random"),
    "recency, budget 896": StillConfig(routing="recency"),
    # More picks a chunk (lambda 56 and 60 of 64), uncapped: does a whole UUID (34 tokens) survive?
    "saliency, uncapped, 56 a chunk": StillConfig(budget=128 + 56 * 680, max_chunks=680),
    "saliency, uncapped, 60 a chunk": StillConfig(budget=128 + 60 * 680, max_chunks=680),
    # The paper's other routing metrics (its S-NIAH table), at our budget; appended, so that the
    # indices above keep their meaning.
    "diagonal, budget 896": StillConfig(routing="diagonal"),
    "dot, budget 896": StillConfig(routing="dot"),
    "key_norm, budget 896": StillConfig(routing="key_norm"),
    "uniform, budget 896": StillConfig(routing="uniform"),
}


def needle_name(result: dict) -> str:
    return result["task"] + (f" (variant {result['variant']})" if result.get("variant") else "")


def markdown(result: dict, model: str) -> str:
    lengths = result["lengths"]
    header = "| variant | " + " | ".join(length_label(n) for n in lengths) + " |"
    lines = [f"# The {needle_name(result)} needle under STILL's routing: {model}", "",
             f"Depths {result['depths']}, one prompt each, seed {result['seed']}; per chunk: "
             + ", ".join(f"{name} {cfg['per_chunk']}" for name, cfg in result["configs"].items()), "",
             "## Reachable: share of (prompt, layer, KV head) with one whole copy of the key softmax-visible", "",
             header, "|---|" + "---|" * len(lengths)]
    for name, by_length in result["results"].items():
        lines.append(f"| {name} | " + " | ".join(f"{by_length[str(n)]['reachable']:.3f}" for n in lengths) + " |")
    lines += ["", "## The key's tokens: visible / folded on leaving the window / evicted from the slots", "",
              header, "|---|" + "---|" * len(lengths)]
    for name, by_length in result["results"].items():
        cells = [by_length[str(n)]["tokens"] for n in lengths]
        lines.append(f"| {name} | " + " | ".join(f"{c[VISIBLE]:.2f} / {c[LEFT_WINDOW]:.2f} / {c[EVICTED]:.2f}"
                                                   for c in cells) + " |")
    return "\n".join(lines + ["", "![reachable by length and layer](routing.png)", ""])


def plot(result: dict, path: Path) -> None:
    lengths, results = result["lengths"], result["results"]
    fig = Figure(figsize=(4 + 2.6 * len(results), 4.2), layout="constrained")
    axes = fig.subplots(1, 1 + len(results), width_ratios=[2.2] + [1] * len(results))
    for name, by_length in results.items():
        axes[0].plot(range(len(lengths)), [by_length[str(n)]["reachable"] for n in lengths], marker="o", label=name)
    axes[0].set_xticks(range(len(lengths)), [length_label(n) for n in lengths])
    axes[0].set(xlabel="prompt length (tokens)", ylabel="reachable share", ylim=(0, 1),
                title="key softmax-visible at the question")
    axes[0].legend(fontsize=7)
    for ax, (name, by_length) in zip(axes[1:], results.items()):
        grid = [list(values) for values in zip(*(by_length[str(n)]["reachable_by_layer"] for n in lengths))]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [length_label(n) for n in lengths], fontsize=7)
        ax.set(xlabel="length", ylabel="layer", title=name)
        ax.title.set_fontsize(8)
    fig.colorbar(image, ax=axes[1:], label="reachable share of KV heads")
    save_png(fig, path, dpi=110)


# The key's shares first, then the linear terms'.
MASS_SERIES = {name: MASS_SHARES[name] for name in ("needle", "needle_linear", "needle_softmax_only", "linear")}


def mass_markdown(result: dict, model: str) -> str:
    lengths = result["lengths"]
    lines = [f"# The question's attention on the {needle_name(result)} needle: {model}", "",
             (f"Depths {result['depths']}, one prompt each, seed {result['seed']}. From the last prompt token: "
              "for the key, the best (layer, query head) of each prompt; for the linear terms, the mean over "
              "layers and heads; each averaged over the prompts."), "",
             "| share | " + " | ".join(length_label(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for name, label in MASS_SERIES.items():
        lines.append(f"| {label} | " + " | ".join(f"{result['results'][str(n)][name]['best']:.3f}" for n in lengths)
                     + " |")
    return "\n".join(lines + ["", "![by length and layer](mass.png)", ""])


def mass_plot(result: dict, path: Path) -> None:
    lengths, results = result["lengths"], result["results"]
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    axes = fig.subplots(1, 3, width_ratios=[2.2, 1, 1])
    for name, label in MASS_SERIES.items():
        axes[0].plot(range(len(lengths)), [results[str(n)][name]["best"] for n in lengths], marker="o", label=label)
    axes[0].set_xticks(range(len(lengths)), [length_label(n) for n in lengths])
    axes[0].set(xlabel="prompt length (tokens)", ylabel="share", ylim=(0, 1), title="attention at the question")
    axes[0].legend(fontsize=7)
    for ax, name in zip(axes[1:], ("needle", "linear")):
        grid = [list(values) for values in zip(*(results[str(n)][name]["by_layer"] for n in lengths))]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(lengths)), [length_label(n) for n in lengths], fontsize=7)
        ax.set(xlabel="length", ylabel="layer", title=MASS_SERIES[name])
        ax.title.set_fontsize(8)
    fig.colorbar(image, ax=axes[1:], label="share")
    save_png(fig, path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lengths", default="1k,2k,4k,8k")
    parser.add_argument("--depths", default="0,25,50,75,100")
    parser.add_argument("--task", default="passkey", choices=["passkey", "niah_single"])
    parser.add_argument("--variant", type=int, choices=[1, 2, 3], help="niah_single's: 3 hides a UUID")
    parser.add_argument("--configs", help="indices into the routing variants (comma-separated; all by default)")
    parser.add_argument("--parts", default="routing,mass", help="routing, mass or both (comma-separated)")
    parser.add_argument("--out", type=Path, default=Path("docs/results/still-routing"))
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if parts - {"routing", "mass"}:
        parser.error(f"--parts takes routing and/or mass, not {args.parts!r}")
    names = list(VARIANTS)
    configs = {names[int(i)]: VARIANTS[names[int(i)]] for i in args.configs.split(",")} if args.configs else VARIANTS
    needle = {"task": args.task, "variant": args.variant}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model(args.model, device=device), load_tokenizer(args.model)
    lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
    args.out.mkdir(parents=True, exist_ok=True)
    def write(name: str, result: dict, to_markdown, draw) -> None:
        (args.out / f"{name}.json").write_text(compact_json(result) + "\n")
        (args.out / f"{name}.md").write_text(to_markdown(result, args.model))
        draw(result, args.out / f"{name}.png")
        print(f"wrote {args.out}/{name}.md, {name}.json, {name}.png")

    if "routing" in parts:
        write("routing", needle_routing(model, tokenizer, configs, **needle, lengths=lengths, depths=depths,
                                        progress=lambda n, d: print(f"routed {n} tokens at depth {d:g}%", flush=True)),
              markdown, plot)
    if "mass" in parts:
        write("mass", needle_mass(model, tokenizer, **needle, lengths=lengths, depths=depths,
                                  progress=lambda n, d: print(f"weighed {n} tokens at depth {d:g}%", flush=True)),
              mass_markdown, mass_plot)


if __name__ == "__main__":
    main()
