"""How the order of waiting turns changes answering's decode steps: a turn-level model of the decoding engine.

    python benchmarks/regen_schedule_sim.py .mix/mix-math-48k.jsonl.gz [--rows 1024] [--refill-min 128]

The GPU main job's prompts (`python -m dflash_trainer.data.prompts mix-math --export ... --limit 48000`) as
conversations of 1 to 8 assistant turns; a turn's reply length drawn to match the 2026-12-01 main job (mean ~113
tokens, 27.7 % cut at 256), its prompt length growing with the turn. `rows` rows decode one token per step; at least
`refill_min` free rows (or all waiting requests fitting) are refilled from the queue; a finished turn queues the
conversation's next one. Prints decode steps and row occupancy for the engine's old order (shortest prompt first) and
its order now (turns of multi-turn conversations first, longest chains first; `Request.priority`). A model, not a
measurement: prefill time and step times that grow with the context are left out.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random

from dflash_trainer.target.regenerate import _assistant_slots, load_conversations


def decode_steps(turns: list[int], reply: dict, prompt: dict, *, chains_first: bool, rows: int, refill_min: int):
    order = itertools.count()
    queue: list = []

    def push(index: int, turn: int) -> None:
        count = turns[index]
        priority = (1 if count == 1 else -(count - turn)) if chains_first else 0
        heapq.heappush(queue, (priority, prompt[index, turn], next(order), (index, turn)))

    for index in range(len(turns)):
        push(index, 0)
    running: list = []  # (step the reply ends, key)
    step = busy = 0
    while queue or running:
        free = rows - len(running)
        if queue and (free >= refill_min or len(queue) <= free):
            for _ in range(min(free, len(queue))):
                key = heapq.heappop(queue)[-1]
                heapq.heappush(running, (step + reply[key], key))
        next_end = running[0][0]
        busy += (next_end - step) * len(running)
        step = next_end
        while running and running[0][0] == step:
            index, turn = heapq.heappop(running)[1]
            if turn + 1 < turns[index]:
                push(index, turn + 1)
    return step, busy / (step * rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--refill-min", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    turns = [len(_assistant_slots(c.messages)) for c in load_conversations(args.prompts)]
    rng = random.Random(args.seed)
    keys = [(index, turn) for index, count in enumerate(turns) for turn in range(count)]
    reply = {key: 256 if rng.random() < 0.277 else max(1, min(255, int(rng.expovariate(1 / 60)))) for key in keys}
    prompt = {(index, turn): 60 + 150 * turn + rng.randint(0, 80) for index, turn in keys}
    print(f"{len(turns):,} conversations, {len(keys):,} turns, {sum(t > 1 for t in turns):,} with more than one")
    for chains_first, name in ((False, "shortest prompt first"), (True, "multi-turn chains first")):
        steps, occupancy = decode_steps(
            turns, reply, prompt, chains_first=chains_first, rows=args.rows, refill_min=args.refill_min
        )
        print(f"{name:>24}: {steps:,} decode steps, rows busy {100 * occupancy:.1f} %")


if __name__ == "__main__":
    main()
