"""How the order of waiting turns changes answering's decode work: a turn-level model of the decoding engine.

    python benchmarks/regen_schedule_sim.py .mix/mix-math-48k.jsonl.gz [--rows 1024] [--refill-min 128]

The math-first GPU recipe's prompts (`python -m dflash_trainer.data.prompts mix-math --export ... --limit 48000`) as
conversations of 1 to 8 assistant turns. A turn's prompt length is estimated from its characters (4 per token, plus
the chat template's tokens and the earlier replies), its reply length drawn to match the 2026-12-01 main job (mean
~113 tokens, 27.7 % cut at 256). `rows` rows decode one token per step; at least `refill_min` free rows (or all
waiting requests fitting) are refilled from the queue; a finished turn queues its conversation's next one.

Printed for the engine's old order (shortest prompt first) and its order now (turns of multi-turn conversations
first, most turns left first; `Request.priority`): decode steps, rows busy, and the attended length summed over
steps (each step reads every row's KV cache up to the longest row's position, rounded up to 128: the part of a
SmolLM2 decode step that grows with context). A model, not a measurement: prefill is left out, and a real step
costs a fixed part (the weights) plus the attended part.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random

import numpy as np

from dflash_trainer.targets.regenerate import _assistant_slots, load_conversations

KV_BUCKET = 128
TEMPLATE_TOKENS = 8  # per message: role markers and separators


def simulate(turns, reply, prompt, *, chains_first: bool, rows: int, refill_min: int) -> tuple[int, float, int]:
    """(decode steps, fraction of row-steps busy, attended length summed over steps)."""
    order = itertools.count()
    queue: list = []

    def push(index: int, turn: int) -> None:
        count = turns[index]
        priority = (1 if count == 1 else -(count - turn)) if chains_first else 0
        heapq.heappush(queue, (priority, prompt[index, turn], next(order), (index, turn)))

    for index in range(len(turns)):
        push(index, 0)
    ends: list = []  # (step the reply ends, row, key)
    free = list(range(rows))
    offset = np.full(rows, -np.inf)  # a running row's position at step s is offset + s
    step = busy = attended = 0
    while queue or ends:
        if queue and (len(free) >= refill_min or len(queue) <= len(free)):
            for _ in range(min(len(free), len(queue))):
                key = heapq.heappop(queue)[-1]
                row = free.pop()
                offset[row] = prompt[key] - step
                heapq.heappush(ends, (step + reply[key], row, key))
        next_end = ends[0][0]
        span = next_end - step
        longest = float(offset.max()) + step  # the longest row's position now; it grows one per step
        positions = longest + np.arange(1, span + 1)
        attended += int((np.ceil(positions / KV_BUCKET) * KV_BUCKET).sum())
        busy += span * (rows - len(free))
        step = next_end
        while ends and ends[0][0] == step:
            _, row, (index, turn) = heapq.heappop(ends)
            offset[row] = -np.inf
            free.append(row)
            if turn + 1 < turns[index]:
                push(index, turn + 1)
    return step, busy / (step * rows), attended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--refill-min", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    conversations = load_conversations(args.prompts)
    rng = random.Random(args.seed)
    turns, reply, prompt = [], {}, {}
    for index, conversation in enumerate(conversations):
        slots = _assistant_slots(conversation.messages)
        turns.append(len(slots))
        for turn, slot in enumerate(slots):
            reply[index, turn] = 256 if rng.random() < 0.277 else max(1, min(255, int(rng.expovariate(1 / 60))))
            before = conversation.messages[:slot]
            earlier_replies = sum(reply[index, t] for t in range(turn))
            user_chars = sum(len(m["content"]) for m in before if m["role"] != "assistant")
            prompt[index, turn] = user_chars // 4 + TEMPLATE_TOKENS * (len(before) + 1) + earlier_replies
    print(f"{len(turns):,} conversations, {len(reply):,} turns, {sum(t > 1 for t in turns):,} with more than one")
    results = {}
    for chains_first, name in ((False, "shortest prompt first"), (True, "multi-turn chains first")):
        results[name] = simulate(
            turns, reply, prompt, chains_first=chains_first, rows=args.rows, refill_min=args.refill_min
        )
        steps, busy, attended = results[name]
        print(f"{name:>24}: {steps:,} decode steps, rows busy {100 * busy:.1f} %, attended {attended / 1e6:.2f}M")
    (old_steps, _, old_attended), (new_steps, _, new_attended) = results.values()
    steps_change, attended_change = new_steps / old_steps - 1, new_attended / old_attended - 1
    print(f"change: steps {100 * steps_change:+.1f} %, attended {100 * attended_change:+.1f} %")


if __name__ == "__main__":
    main()
