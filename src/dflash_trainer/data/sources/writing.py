"""`writing`: open-ended requests for long-form text, composed from templates and lists written for this project.

The prompts are requests of the kinds people send an assistant when they want a text written: blog posts,
explanations for a beginner or a child, summaries of what is known about a subject, lesson plans, emails and letters
for many purposes, stories, poems and song lyrics, speeches, cover letters, product descriptions and reviews,
step-by-step guides, pros and cons, persuasive essays, scripts, itineraries, a professional's advice in role-play.
Each of `TEMPLATES` is one such request with slots, filled from the lists at the end of this file (subjects of
science, history, society and the arts, hobbies, jobs, products, kinds of places, characters, occasions, ...). A
template is a sub-task: ids are `writing:<template>:<index>`.

Where the words come from: the templates and the lists were written for this project in our own words, so the set is
under the project's licence (Apache-2.0) and reads no package data. No benchmark's wording is used. MT-Bench's
questions were read only to keep away from them: no prompt shares a run of six words with one of their turns (a
test checks it), and the subjects they ask about (photosynthesis, quantum entanglement, machine learning, antitrust
law, ...) are not in the lists, so training on this set does not rehearse a held-out evaluation.

Why: the other sources are mostly short-answer benchmark items, so a drafter trained on them sees little of the
target's long-form prose and accepts poorly on open-ended requests, the bulk of MT-Bench and of chat traffic. These
prompts, answered by the target, add that prose: over 20,000 distinct requests.

Determinism and distinctness: a template's subject slots say what the text is about (a topic; a character and a
predicament; a place, a season and a traveller), and each combination of them is used at most once per template, so
no two prompts of a template ask for the same text. Its other slots, the style slots (length, tone, audience, ...),
vary the request around its subject. A template gives `caps.cap(template)` prompts (default `DEFAULT_PER_TEMPLATE`),
or every combination when there are fewer: a sample of the combinations drawn with `caps.rng` (a seeded
`random.Random`, the same on every run and platform), in the lists' order, then one draw per style slot, prompt by
prompt. So prompt `writing:<template>:<index>` depends only on the seed and this file (a mixture's cache, keyed on
the sources' code, is built again when it changes).
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from dflash_trainer import __version__

from .base import Caps, PackageData, Prompt, Tally, no_split, user_prompt

NAME = "writing"
# Nothing to install: the prompts are made by this project's own code.
PACKAGE = PackageData("dflash-trainer", "dflash_trainer", __version__)
DEFAULT_PER_TEMPLATE = 800


@dataclass(frozen=True)
class Template:
    """A request with `{slot}` fields (`{slot[0]}`, `{slot[1]}` for a slot whose values are pairs). `subjects` are the
    slots that say what the text is about; every other slot of the text is a style slot. Each slot is a list of
    `POOLS`."""

    name: str
    text: str
    subjects: tuple[str, ...]

    def slots(self) -> tuple[str, ...]:
        """The slots of the text in order of first appearance."""
        fields = (field for _, field, _, _ in string.Formatter().parse(self.text) if field)
        return tuple(dict.fromkeys(field.split("[")[0] for field in fields))

    def styles(self) -> tuple[str, ...]:
        return tuple(slot for slot in self.slots() if slot not in self.subjects)

    def combinations(self) -> int:
        return math.prod(len(POOLS[slot]) for slot in self.subjects)


class Request(NamedTuple):
    """One composed prompt: its text and the slot values it was made of."""

    text: str
    subjects: tuple[object, ...]  # in the order of `Template.subjects`
    styles: tuple[object, ...]  # in the order of `Template.styles()`


def compose(template: Template, caps: Caps) -> list[Request]:
    """The template's requests: `caps.cap(template.name)` (default `DEFAULT_PER_TEMPLATE`) distinct combinations of
    its subject slots, or all of them when there are fewer, seeded by `caps.seed`; see the module docstring."""
    pools = [POOLS[slot] for slot in template.subjects]
    style_slots = template.styles()
    combinations = template.combinations()
    count = min(combinations, caps.cap(template.name) or DEFAULT_PER_TEMPLATE)
    rng = caps.rng(NAME, template.name)
    requests = []
    for number in sorted(rng.sample(range(combinations), count)):
        subjects = []
        for pool in reversed(pools):  # the number in mixed radix, the last slot's digit first
            number, digit = divmod(number, len(pool))
            subjects.append(pool[digit])
        subjects.reverse()
        styles = tuple(rng.choice(POOLS[slot]) for slot in style_slots)
        values = dict(zip(template.subjects, subjects, strict=True)) | dict(zip(style_slots, styles, strict=True))
        requests.append(Request(template.text.format(**values), tuple(subjects), styles))
    return requests


def load(package_dir: Path, split: str, caps: Caps, tally: Tally) -> list[Prompt]:
    """Every template's requests, template by template in `TEMPLATES` order (`package_dir` is not read)."""
    no_split(NAME, split)
    prompts = []
    for template in TEMPLATES:
        requests = compose(template, caps)
        prompts.extend(user_prompt(f"{NAME}:{template.name}:{index}", r.text) for index, r in enumerate(requests))
        tally.keep(NAME, template.name, len(requests))
    return prompts


def _lines(block: str) -> tuple[str, ...]:
    """The non-empty lines of `block`, stripped."""
    return tuple(line.strip() for line in block.splitlines() if line.strip())


def _pairs(block: str) -> tuple[tuple[str, str], ...]:
    """Lines `first | second` of `block` as pairs."""
    pairs = []
    for line in _lines(block):
        first, second = (part.strip() for part in line.split("|"))
        pairs.append((first, second))
    return tuple(pairs)


TEMPLATES = (
    # Explaining and informing: one per topic.
    Template(
        "blog_post",
        "Write a blog post about {topic}. Aim for {length}, keep the voice {tone}, and break it up with a title and "
        "subheadings.",
        ("topic",),
    ),
    Template(
        "explain_beginner",
        "I know almost nothing about {topic}. Explain it to me from the ground up, define each technical term when it "
        "first appears, and finish with a short recap.",
        ("topic",),
    ),
    Template(
        "explain_child",
        "Explain {topic} to a child of {child_age}, comparing it with things they see every day. Keep the sentences "
        "short and end with a question they could think about.",
        ("topic",),
    ),
    Template(
        "knowledge_summary",
        "Summarise what is known about {topic}: the well-established ideas, the questions that are still debated, "
        "and where a curious reader could go next.",
        ("topic",),
    ),
    Template(
        "faq_page",
        "Write a frequently asked questions page about {topic}, with {faq_count} questions a newcomer would ask and a "
        "clear answer to each.",
        ("topic",),
    ),
    Template(
        "myths_and_facts",
        "What do people commonly get wrong about {topic}? List the most widespread misconceptions and correct each "
        "one in a short paragraph.",
        ("topic",),
    ),
    Template(
        "lesson_plan",
        "Put together a lesson plan on {topic} for {learners}, lasting {lesson_length}: learning goals, a warm-up, "
        "the main activities with timings, and a short check of what was learned.",
        ("topic",),
    ),
    Template(
        "talk_outline",
        "Draft a talk of {slide_count} slides on {topic} for {talk_audience}. For each slide give a heading, its key "
        "points and a few lines of speaker notes.",
        ("topic",),
    ),
    Template(
        "podcast_script",
        "Write the script of a {podcast_minutes}-minute podcast episode in which two hosts, an expert and a curious "
        "newcomer, talk through {topic}.",
        ("topic",),
    ),
    Template(
        "encyclopedia_entry",
        "Write an encyclopedia-style article on {topic}: a one-paragraph overview, then sections on the background, "
        "the key ideas, and why it matters today.",
        ("topic",),
    ),
    Template(
        "study_notes",
        "Write revision notes on {topic} for a student: the key terms with definitions, the main points as bullets, "
        "and three practice questions with answers.",
        ("topic",),
    ),
    Template(
        "quiz",
        "Write a quiz of ten questions on {topic}, mixing easy and hard ones, with the answers and a one-sentence "
        "explanation for each.",
        ("topic",),
    ),
    # Hobbies and practical help.
    Template(
        "hobby_starter_guide",
        "I want to take up {hobby} {hobby_circumstance}. Write me a beginner's guide: what I need to start, what to "
        "learn first, mistakes to avoid, and how to keep going when progress feels slow.",
        ("hobby", "hobby_circumstance"),
    ),
    Template(
        "practice_plan",
        "Make a four-week plan for someone learning {hobby} who can practise {practice_time}, with a goal for each "
        "week and what to do in each session.",
        ("hobby", "practice_time"),
    ),
    Template(
        "how_to_guide",
        "Give me step-by-step instructions to {task}: what to have ready before starting, each step in order, and "
        "what to do if something goes wrong.",
        ("task",),
    ),
    Template(
        "troubleshooting",
        "{trouble}. Walk me through finding the cause, starting with the simplest and cheapest checks, and tell me "
        "when it is time to call in a professional.",
        ("trouble",),
    ),
    Template(
        "event_plan",
        "Help me organise {event}. Lay out a timeline of tasks from eight weeks before to the day itself, a rough "
        "budget, and the things that most often go wrong.",
        ("event",),
    ),
    Template(
        "invitation",
        "Write the invitation for {event}: the details guests need, what to bring, how to reply, and a friendly line "
        "that makes people want to come.",
        ("event",),
    ),
    Template(
        "recipe",
        "Write a recipe for {dish} that {cook} could follow: ingredients with quantities, numbered steps, timings, "
        "and how to tell when it is done.",
        ("dish",),
    ),
    Template(
        "meal_plan",
        "Plan a week of {diet} dinners for {household}, with a short note on each meal and a shopping list grouped by "
        "type of food.",
        ("diet", "household"),
    ),
    Template(
        "training_plan",
        "Write a plan for the next {plan_weeks} weeks to help me {goal}. I am starting {starting_point}; say what to "
        "do each week and how to tell whether I am on track.",
        ("goal",),
    ),
    # Arguing and weighing up.
    Template(
        "persuasive_essay",
        "Write a persuasive essay arguing that {claim}. Use evidence and examples, take on the strongest objection, "
        "and end with a memorable closing line.",
        ("claim",),
    ),
    Template(
        "debate_both_sides",
        "Set out the best case for and the best case against the idea that {claim}, as fairly as you can, then say "
        "which side you find more convincing and why.",
        ("claim",),
    ),
    Template(
        "letter_to_editor",
        "Write a letter to the editor of a local newspaper {stance} the idea that {claim}, in under 400 words.",
        ("claim",),
    ),
    Template(
        "pros_and_cons",
        "I'm trying to choose between {choice[0]} and {choice[1]}. Give me the pros and cons of each, the situations "
        "where each is the better choice, and questions to ask myself before deciding.",
        ("choice",),
    ),
    Template(
        "comparison_table",
        "Compare {choice[0]} with {choice[1]} in a table covering cost, convenience, long-term effects and who each "
        "suits best, then sum up the differences in a short paragraph.",
        ("choice",),
    ),
    # Advice and role-play.
    Template(
        "advice_letter",
        "Write a letter of advice to {advisee} who {situation}. Be warm and honest, give practical suggestions, and "
        "keep it personal rather than preachy.",
        ("situation",),
    ),
    Template(
        "roleplay_advice",
        'You are {consultation[0]}. Someone who has come to you for help says: "{consultation[1]}" Answer them as that '
        "professional would, in plain language, with what to do now and when to seek further help.",
        ("consultation",),
    ),
    Template(
        "roleplay_interview",
        "Stay in character as {job} being interviewed for a careers magazine. Describe a typical working day, the "
        "hardest part of the job, what people misunderstand about it, and advice for someone starting out.",
        ("job",),
    ),
    # Work.
    Template(
        "cover_letter",
        "Write a cover letter for {applicant} applying to work as {job}. Make it specific, confident without "
        "boasting, and no longer than one page.",
        ("job", "applicant"),
    ),
    Template(
        "job_advert",
        "Write a job advertisement for {job}: what the role involves, the skills and experience needed, what the "
        "employer offers, and how to apply.",
        ("job",),
    ),
    Template(
        "resignation_letter",
        "Write a resignation letter for {job} who is leaving {leaving_reason}. Keep it gracious, offer help with the "
        "handover, and thank the employer.",
        ("job", "leaving_reason"),
    ),
    Template(
        "interview_questions",
        "List ten questions for a job interview with someone applying to work as {job}, and for each say what a "
        "strong answer would show.",
        ("job",),
    ),
    # Products and customers.
    Template(
        "product_description",
        "Write a product description for {product} for an online shop: a headline, a short paragraph on who it is "
        "for, and five bullet points on its features.",
        ("product",),
    ),
    Template(
        "product_review",
        "Write an honest customer review of {product} after {usage_period} of use: what you liked, what disappointed "
        "you, and who you would recommend it to.",
        ("product",),
    ),
    Template(
        "launch_email",
        "Write an email to a shop's existing customers announcing {product}: what problem it solves, an introductory "
        "offer, and a clear call to action.",
        ("product",),
    ),
    Template(
        "ad_campaign",
        "Come up with an advertising campaign for {product}: three slogans, a script for a 30-second radio advert, "
        "and a short social media post.",
        ("product",),
    ),
    Template(
        "complaint_email",
        "Write a complaint email to a company about {product} that {product_problem}. Be firm but polite, give the "
        "relevant details, and say what outcome you expect.",
        ("product", "product_problem"),
    ),
    Template(
        "customer_service_reply",
        "You answer customer emails for {business}. Write a reply to a customer who {customer_issue}, keeping their "
        "goodwill while being honest about what you can and cannot do.",
        ("business", "customer_issue"),
    ),
    # Places and travel.
    Template(
        "itinerary",
        "Plan a {trip_days}-day trip to {place} in {season} for {traveller}: a day-by-day schedule, where to eat, how "
        "to get around, and a rough budget.",
        ("place", "season", "traveller"),
    ),
    Template(
        "place_description",
        "Describe {place} {time_of_day} in {season} for someone who has never been there: what they would see and "
        "hear, who they would meet, and how it would feel to be there.",
        ("place", "time_of_day", "season"),
    ),
    Template(
        "packing_list",
        "Write a packing list for {traveller} spending a week in {place} in {season}, grouped by category, with a "
        "note on anything easy to forget.",
        ("place", "season", "traveller"),
    ),
    # Fiction.
    Template(
        "short_story",
        "Write a {story_mood} short story about {character} who {predicament}. Give it a title and keep it under "
        "{story_words} words.",
        ("character", "predicament"),
    ),
    Template(
        "story_opening",
        "Write the opening scene of a novel about {character} who {predicament}. Introduce the main character "
        "through action, hint at what is at stake, and stop at a moment that makes the reader want to turn the page.",
        ("character", "predicament"),
    ),
    Template(
        "film_pitch",
        "Write a one-page pitch to a film studio for a film about {character} who {predicament}: the genre, the "
        "audience, the main turning points and how it ends.",
        ("character", "predicament"),
    ),
    Template(
        "bedtime_story",
        "Write a gentle bedtime story for a child of {young_age} about {creature} who {small_adventure}. End it "
        "calmly, so it helps them settle to sleep.",
        ("creature", "small_adventure"),
    ),
    Template(
        "fable",
        "Write an original fable with animal characters whose moral is that {moral}. State the moral in one line at "
        "the end.",
        ("moral",),
    ),
    Template(
        "dialogue_scene",
        "Write a short script for a scene between {pair}. They are {scene_setting}. Reveal their personalities through "
        "what they say, and end the scene with a surprise.",
        ("pair", "scene_setting"),
    ),
    # Poetry and song.
    Template(
        "poem",
        "Write {poem_form} about {poem_subject}, with a {mood} mood.",
        ("poem_subject", "poem_form"),
    ),
    Template(
        "song_lyrics",
        "Write the lyrics of {song_kind} about {poem_subject}, with two verses, a chorus that repeats and a bridge.",
        ("poem_subject", "song_kind"),
    ),
    # Occasions, letters and news.
    Template(
        "speech",
        "Write a speech of about {speech_minutes} minutes for {occasion}. Open with something that catches the "
        "audience's attention, include a personal touch, and close on a line people will remember.",
        ("occasion",),
    ),
    Template(
        "request_email",
        "Write a polite, concise email to {request}. Explain the reason briefly and make it easy for them to say yes.",
        ("request",),
    ),
    Template(
        "thank_you_note",
        "Write a heartfelt thank-you note to {thanks}, saying specifically what the help meant to me.",
        ("thanks",),
    ),
    Template(
        "apology_note",
        "Write a sincere apology {apology}, taking responsibility without making excuses and saying what I will do "
        "differently.",
        ("apology",),
    ),
    Template(
        "news_article",
        "Write a local news article reporting that {news}. Include a headline, the key facts in the first paragraph, "
        "and quotes from two people involved.",
        ("news",),
    ),
    Template(
        "restaurant_review",
        "Write a review of {restaurant} for a local food blog after {visit}: the food, the service, the "
        "atmosphere and value for money, with a score out of ten.",
        ("restaurant", "visit"),
    ),
)


# ----------------------------------------------------------------------------------------------------------
# Style slots: how a request is put, drawn once per prompt.

STYLES = {
    "length": _lines("""
        about 600 words
        roughly 800 words
        around 1,000 words
        five or six short sections
        something that takes about five minutes to read
    """),
    "tone": _lines("""
        warm and conversational
        lively and a little humorous
        calm and authoritative
        enthusiastic but practical
        thoughtful and reflective
        plain and no-nonsense
    """),
    "child_age": _lines("""
        six
        seven
        eight
        nine
        ten
    """),
    "faq_count": _lines("""
        eight
        ten
        twelve
    """),
    "learners": _lines("""
        pupils aged 9 to 10
        pupils aged 11 to 12
        students aged 13 to 14
        students aged 15 to 16
        adults at an evening class
    """),
    "lesson_length": _lines("""
        one 45-minute period
        one hour
        two 50-minute periods
    """),
    "slide_count": _lines("""
        six
        eight
        ten
        twelve
    """),
    "talk_audience": _lines("""
        curious adults with no background in the subject
        secondary school students
        members of a retirement community
        new employees at a company learning day
        parents at a school information evening
        volunteers at a local museum
    """),
    "podcast_minutes": _lines("""
        10
        15
        20
        30
    """),
    "cook": _lines("""
        a complete beginner
        a teenager cooking for the family for the first time
        a busy parent on a weeknight
        someone cooking for guests for the first time
        a confident home cook
    """),
    "plan_weeks": _lines("""
        six
        eight
        ten
        twelve
    """),
    "starting_point": _lines("""
        from scratch
        after a long break
        with a little experience but no routine
        with an old injury I need to be careful of
        with very little free time
    """),
    "stance": _lines("""
        supporting
        opposing
    """),
    "advisee": _lines("""
        a younger cousin
        a close friend
        my nephew
        my niece
        an old school friend
        a former colleague
        my younger brother
        my older sister
    """),
    "usage_period": _lines("""
        a week
        a month
        three months
        six months
        a year
    """),
    "trip_days": _lines("""
        two
        three
        four
        five
        seven
    """),
    "story_mood": _lines("""
        funny
        mysterious
        heartwarming
        spooky
        bittersweet
        suspenseful
        whimsical
        gentle
        tense
        playful
    """),
    "story_words": _lines("""
        500
        800
        1,000
        1,500
    """),
    "young_age": _lines("""
        three
        four
        five
        six
        seven
    """),
    "mood": _lines("""
        hopeful
        wistful
        playful
        quiet
        joyful
        melancholy
        tender
        defiant
    """),
    "speech_minutes": _lines("""
        two
        three
        five
        eight
    """),
}


# ----------------------------------------------------------------------------------------------------------
# Subject slots: what a text is about. Every entry fits the templates that use its slot (read them in place).

# Subjects to explain, summarise or teach, in science, technology, health, history, society and the arts.
TOPICS = _lines("""
    how rainbows form
    why the sky looks blue on a clear day
    how the Moon causes the tides
    the life cycle of a star
    black holes
    why we have seasons
    the phases of the Moon
    how earthquakes happen
    how volcanoes form
    plate tectonics
    the rock cycle
    how fossils form
    the water cycle
    how clouds form
    how lightning works
    how hurricanes form
    the greenhouse effect
    the ozone layer
    how magnets work
    static electricity
    how electricity reaches our homes
    the difference between heat and temperature
    how sound travels
    the Doppler effect
    why some things float and others sink
    friction
    Newton's three laws of motion
    gravity
    how aeroplanes stay in the air
    the speed of light
    how telescopes work
    what atoms are made of
    the periodic table
    how chemical bonds hold molecules together
    acids and bases
    how soap removes grease
    why ice floats on water
    how batteries store energy
    nuclear fission
    how the Sun produces energy
    radioactivity and half-life
    how traits pass from parents to children
    natural selection
    how cells divide
    the human immune system
    how vaccines work
    antibiotics and antibiotic resistance
    the difference between viruses and bacteria
    the gut microbiome
    how the heart pumps blood
    how the lungs work
    how the brain forms memories
    why we need sleep
    how the eye sees colour
    how hearing works
    the nervous system
    what hormones do in the body
    how muscles grow stronger
    how bees make honey
    bird migration
    how bats use echolocation
    animal camouflage
    coral reefs
    food chains and food webs
    pollination
    the nitrogen cycle
    the carbon cycle
    why species go extinct
    how whales evolved from land animals
    why the dinosaurs died out
    the planets of the solar system
    the search for life on other planets
    comets and asteroids
    solar and lunar eclipses
    the Big Bang theory
    how GPS works
    time zones
    how the internet works
    how search engines rank pages
    how an email gets delivered
    cloud computing
    how computer memory works
    what an operating system does
    how computer programs are compiled
    open-source software
    how encryption keeps messages private
    password managers
    two-factor authentication
    phishing scams
    computer viruses and other malware
    how Wi-Fi works
    how mobile phone networks work
    how touchscreens work
    how digital cameras capture images
    how QR codes work
    3D printing
    how electric cars work
    how wind turbines generate electricity
    how hydroelectric dams work
    how a refrigerator keeps food cold
    how a microwave oven heats food
    how a car engine works
    self-driving cars
    delivery drones
    robots in factories
    blockchain
    cryptocurrencies
    how video streaming works
    data compression
    how websites are built
    databases
    what spreadsheets are good for
    the binary number system
    logic gates
    how lifts work
    how skyscrapers cope with strong winds
    how tap water is made safe to drink
    how sewage is treated
    how recycling plants sort materials
    how canal locks work
    how video games are made
    virtual reality
    smart home devices
    a balanced diet
    dietary fibre
    vitamins and minerals
    staying hydrated
    the benefits of regular exercise
    stretching and flexibility
    posture and back pain
    what stress does to the body
    mindfulness meditation
    how habits form
    screen time and children
    caffeine
    sugar in our diet
    food allergies
    hay fever
    the common cold
    high blood pressure
    type 2 diabetes
    cholesterol
    sun protection and skin health
    looking after your teeth
    protecting your hearing
    first aid for burns
    recognising the signs of a stroke
    the placebo effect
    how the body changes as we age
    how painkillers work
    loneliness and health
    burnout at work
    the health effects of noise
    the building of the Egyptian pyramids
    daily life in ancient Rome
    the roads of the Roman Empire
    the Silk Road
    the invention of writing
    the invention of the printing press
    the Viking voyages
    medieval castles
    the Black Death
    the Renaissance
    the voyages of Zheng He
    the Inca Empire
    the Maya civilisation
    the Age of Exploration
    the Scientific Revolution
    the Industrial Revolution
    the abolition of the slave trade
    the steam engine
    the American Revolution
    the French Revolution
    the Meiji Restoration
    the unification of Germany
    the campaign for women's right to vote
    the First World War
    the Great Depression
    the home front in the Second World War
    the Marshall Plan
    the Cold War
    the space race
    the Apollo Moon landings
    the end of colonial rule in Africa
    the civil rights movement in the United States
    the fall of the Berlin Wall
    the end of apartheid in South Africa
    the history of the Olympic Games
    the history of money
    the history of vaccination
    the history of the bicycle
    the history of coffee
    the history of chocolate
    the history of tea
    the history of the calendar
    the history of maps
    the history of the postal service
    the history of photography
    the history of flight
    the history of the railways
    the history of the telephone
    the history of public libraries
    the Great Wall of China
    the building of the Panama Canal
    the Hanseatic League
    the Ottoman Empire
    the Mughal Empire
    democracy in ancient Athens
    the Library of Alexandria
    the Mongol Empire
    Tenochtitlan, the Aztec capital
    the history of the internet
    the history of the personal computer
    the Hubble Space Telescope
    the International Space Station
    the history of medicine in the Middle Ages
    the discovery of penicillin
    the invention of the light bulb
    the history of writing systems in East Asia
    how supply and demand set prices
    compound interest
    how banks lend money
    how the stock market works
    index funds
    how insurance works
    how taxes pay for public services
    how mortgages work
    credit scores
    making a household budget
    the gig economy
    minimum wage laws
    universal basic income
    trade tariffs
    globalisation
    how small businesses get started
    franchising
    crowdfunding
    how advertising persuades us
    how elections work in a parliamentary system
    the separation of powers
    how a law is made
    trial by jury
    human rights
    the United Nations
    how cities are planned
    public transport
    the growth of cities
    housing affordability
    working from home
    the four-day working week
    volunteering
    how charities spend donations
    the sharing economy
    consumer rights
    how opinion polls work
    misinformation online
    advertising aimed at children
    how languages change over time
    growing up bilingual
    sign languages
    how children learn to talk
    confirmation bias
    procrastination
    motivation
    emotional intelligence
    how first impressions form
    the bystander effect
    a growth mindset
    critical thinking
    the history of jazz
    how an orchestra is organised
    how to read sheet music
    the blues
    the origins of hip hop
    opera
    Impressionist painting
    perspective in drawing
    colour theory
    origami
    calligraphy
    how films are edited
    animation
    the hero's journey in storytelling
    how a novel gets published
    Shakespeare's theatre
    Greek mythology
    Norse mythology
    folk tales from around the world
    Gothic cathedrals
    Japanese gardens
    the Japanese tea ceremony
    fermentation in cooking
    the science of baking bread
    the spice trade
    street food around the world
    the history of pizza
    the history of chess
    the rules of cricket
    the offside rule in football
    how the marathon began
    board games through history
    how museums decide what to display
    what libraries do today
    composition in photography
    typography
    how fashion trends come and go
    the history of tattoos
    rainforests
    how life survives in deserts
    the Arctic tundra
    why wetlands matter
    ocean currents
    the deep sea
    plastic pollution in the oceans
    air pollution in cities
    climate change
    composting
    rewilding
    endangered species
    invasive species
    wildlife in cities
    the decline of honeybees
    soil health
    drought
    floods and flood defences
    glaciers
    wildfires
    national parks
    light pollution
    saving water at home
    the environmental cost of fast fashion
    food waste
    reading food labels
    saving for retirement
    negotiating a salary
    time management
    writing a good CV
    job interviews
    professional networking
    learning a new language as an adult
    raising a puppy
    caring for houseplants
    keeping chickens in a back garden
    saving energy at home
    decluttering a home
    minimalism
    planning meals for the week
    good sleep habits
    morning routines
    keeping a journal
    taking a break from screens
    moving to a new city
    parenting teenagers
    talking to children about money
    caring for an ageing parent
    road safety for cyclists
    camping safely
    travel insurance
    jet lag
    choosing a first pet
    tipping customs around the world
    the metric system
    how maps show a round Earth on flat paper
    prime numbers
    probability in everyday life
    statistics in the news
    the golden ratio
    infinity
    fractals
    the history of zero
    how codes and ciphers work
    how weather forecasts are made
    sunspots and the solar cycle
    the northern lights
    meteor showers
    why leaves change colour in autumn
    how trees communicate through fungi
    carnivorous plants
    how octopuses think
    the intelligence of crows
    animal hibernation
    how salmon find their way home
    the life of an ant colony
    sharks
    elephants and their family groups
    wolves and how packs work
    how birds build nests
    the migration of monarch butterflies
    why cats purr
    how dogs were domesticated
    the history of farming
    how bread wheat was domesticated
    the history of the potato
    how cheese is made
    how chocolate is made from cacao beans
    how paper is made
    how glass is made
    how steel is made
    how concrete sets
    the history of children's books
    the life of Marie Curie
    the life of Leonardo da Vinci
    the life of Ada Lovelace
    the life of Nelson Mandela
    the life of Charles Darwin
    the life of Frida Kahlo
    the life of Ibn Battuta
    the life of Mary Seacole
    the Wright brothers
    Galileo and the telescope
    the Rosetta Stone
    Stonehenge
    the terracotta army
    Pompeii
    Machu Picchu
    Angkor Wat
    the Great Barrier Reef
    the Sahara
    the Amazon rainforest
    Antarctica
    the Himalayas
    the Nile
    the Galapagos Islands
    how islands form
    caves and how they form
    the Grand Canyon
    the history of the English language
    where surnames come from
    the history of the alphabet
    Esperanto and other invented languages
    how dictionaries are written
    the history of the circus
    puppetry
    the history of the cinema
    silent films
    radio drama
    the history of comic books
    the history of video games
    the history of skateboarding
    the Tour de France
    the history of football
    the Paralympic Games
    the history of mountaineering
    the first flight across the Atlantic
    polar exploration
    the history of lighthouses
    shipwrecks and underwater archaeology
    the history of clocks
    the history of the toothbrush
    the history of umbrellas
    the history of playgrounds
    the history of the weekend
    how noise-cancelling headphones work
    how smoke alarms work
    how fingerprints identify people
    forensic science
    how a submarine dives and surfaces
    how hot-air balloons fly
    how a sailing boat can sail against the wind
    how a piano makes its sound
    why cutting onions makes us cry
    why bread dough rises
    why popcorn pops
    why metal feels colder than wood
    how a vacuum flask keeps drinks hot
    how fireworks get their colours
    how glue sticks things together
    how the human voice works
    why we yawn
    why we dream
    how we taste food
    left-handedness
    the science of laughter
    blood groups
    how broken bones heal
    how spiders spin silk
    how birds fly
    why zebras have stripes
    how chameleons change colour
    how fireflies glow
    how mountains form
    how rivers shape the land
    sand dunes
    monsoons
    El Niño
    tsunamis
    why the Dead Sea is so salty
    groundwater
    peat bogs
    mangrove forests
    kelp forests
    the history of the piano
    the Bauhaus movement
    Art Nouveau
    the history of the novel
    the history of newspapers
    the history of advertising
    the history of the supermarket
    the history of ice cream
    the history of bread
    the history of salt
    the invention of the wheel
    the history of knives, forks and chopsticks
""")

HOBBIES = _lines("""
    birdwatching
    sourdough baking
    rock climbing
    knitting
    watercolour painting
    chess
    vegetable gardening
    beekeeping
    photography
    running
    cycling
    swimming
    yoga
    pottery
    woodworking
    calligraphy
    playing the guitar
    playing the piano
    singing in a choir
    astronomy
    fishing
    hiking
    kayaking
    sailing
    surfing
    skateboarding
    ice skating
    salsa dancing
    ballroom dancing
    judo
    fencing
    archery
    table tennis
    tennis
    golf
    home brewing
    cheese making
    cake decorating
    fermenting vegetables
    growing vegetables on a balcony
    bonsai
    keeping a freshwater aquarium
    building a model railway
    flying drones
    amateur radio
    electronics with a microcontroller kit
    sewing my own clothes
    embroidery
    crochet
    quilting
    leatherwork
    jewellery making
    candle making
    bookbinding
    writing poetry
    stand-up comedy
    improv theatre
    community theatre
    film photography
    stop-motion animation
    podcasting
    tracing my family history
    stamp collecting
    collecting vinyl records
    geocaching
    orienteering
    trail running
    open-water swimming
    rowing
    hillwalking
    horse riding
    foraging for wild food
    identifying wild mushrooms
    tai chi
    juggling
    magic tricks
    origami
    cryptic crosswords
    learning sign language
    urban sketching
    oil painting
    digital illustration
    drawing comics
    playing the ukulele
    drumming
    DJing
    making music on a computer
    inline skating
    snowboarding
    cross-country skiing
    scuba diving
    mountain biking
    designing board games
    the card game bridge
    solving the Rubik's cube quickly
    restoring old furniture
    upcycling old clothes
    propagating houseplants
    calisthenics
    weightlifting
    pilates
    wild swimming
    bread making with a wood-fired oven
    bird photography
""")

HOBBY_CIRCUMSTANCES = _lines("""
    on a tight budget
    with only a couple of hours a week to spare
    in my sixties
    as a complete beginner who tends to give up quickly
    alongside a demanding full-time job
    mainly to meet new people
    together with my teenage child
    while living far from any big town
""")

PRACTICE_TIMES = _lines("""
    about two hours a week
    for twenty minutes every day
    in one long session each weekend
    on three evenings a week
    for an hour on weekdays only
""")

TASKS = _lines("""
    repot a houseplant
    change the inner tube of a bicycle tyre
    set up a monthly household budget
    paint a room
    unblock a sink without harsh chemicals
    hang a heavy mirror on a plasterboard wall
    bleed a radiator
    fix a dripping tap
    deep-clean an oven
    get a red wine stain out of a carpet
    set up a compost bin
    draught-proof an old window
    assemble flat-pack furniture
    back up the photos on a phone
    set up a home Wi-Fi network securely
    make a strong password that is easy to remember
    speed up an old laptop
    build a simple personal website
    record a podcast at home
    make fresh pasta by hand
    cook fluffy rice in a pan
    bake a loaf of bread
    make a vegetable stock from scraps
    sharpen a kitchen knife
    open a first savings account
    build an emergency fund
    negotiate a lower broadband bill
    write a CV with no work experience
    prepare for a video job interview
    ask for a pay rise
    write a short professional biography
    start running from zero
    learn to touch-type
    memorise a short speech
    read more books in a year
    teach a dog to walk nicely on a lead
    teach a child to ride a bicycle
    plant a young tree
    grow tomatoes in pots
    start a vegetable patch
    make beeswax candles
    wrap a present neatly without tape showing
    iron a shirt
    sew on a button
    hem a pair of trousers
    remove a splinter safely
    jump-start a car
    check the oil and tyre pressure of a car
    clean a bicycle chain
    pack a suitcase for a two-week trip in hand luggage only
    plan a road trip
    move house with as little stress as possible
    set up a fish tank
    introduce a new cat to a resident cat
    clip a dog's nails
    make a bird feeder from recycled materials
    build a raised garden bed
    prune a rose bush
    lay a simple patio
    grout bathroom tiles
    replace a light switch safely
    put up shelves
    fix a squeaky door
    descale a kettle
    clean a cast-iron pan
    make jam
    pickle vegetables
    make yoghurt at home
    brew a good pot of tea
    make cold-brew coffee
    plan a vegetable garden for the year
    collect rainwater for the garden
    start journaling
    meditate for ten minutes a day
    make a family emergency plan
    write a will
    organise a home filing system for paperwork
    declutter a wardrobe
    sell unwanted things online
    set up a small online shop
    write a simple business plan
    register a small business name
    run an effective meeting
    write minutes of a meeting
    give constructive feedback to a colleague
    onboard a new team member
    prepare a presentation in one evening
    learn the basics of a spreadsheet
    make a pivot table
    write a clear email subject line
    organise a photo collection
    digitise old family photos
    make a photo book
    film a short video on a phone
    edit a video for social media
    start a blog
    write a short story for a competition
    enter a local art exhibition
    learn the lyrics of a song quickly
    tune a guitar by ear
    change guitar strings
    start a book club
    host a board game night
    throw a dinner party for eight people
    set a table for a formal dinner
    fold a fitted sheet
    wash a wool jumper without shrinking it
    get rid of fruit flies in a kitchen
    keep slugs off vegetables without poison
    attract butterflies to a garden
    build a bug hotel
    identify the birds in a garden
    read a topographic map
    use a compass
    pitch a tent in the rain
    light a campfire safely
    purify water while hiking
    pack a first-aid kit for a hike
    prepare a child for their first day at school
    childproof a home
    teach a teenager to cook five basic meals
    help a child with reading at home
    talk to a child about a death in the family
    plan a budget wedding
    plan a surprise party without it being discovered
    write a eulogy
    prepare for a marathon
    recover after a long run
    warm up before exercise
    do a proper push-up
    start strength training at home with no equipment
    improve posture at a desk
    set up an ergonomic home office
    fall asleep faster
    stop procrastinating on a big project
    learn a new language with an app and a notebook
    prepare for a driving test
    change a car tyre at the roadside
    save money on the weekly food shop
    cook a week of meals in one afternoon
    freeze food safely
    store fresh herbs so they last
    make a smoothie that keeps you full
    grow herbs on a windowsill
    repair a hole in a wall
    choose paint colours for a small room
    clean windows without streaks
""")

TROUBLES = _lines("""
    My kitchen sink drains very slowly
    My laptop has become painfully slow
    My phone battery is empty by lunchtime
    My Wi-Fi keeps dropping out in one room of the house
    My home-made bread comes out dense and heavy
    The leaves of my houseplant are turning yellow
    My bicycle chain keeps slipping off
    My car makes a squealing noise when I brake
    My washing machine leaves clothes soaking wet
    My fridge is making a loud humming noise
    My shower has very weak water pressure
    My toilet keeps running after it is flushed
    My radiators are cold at the top
    My printer says it is offline even though it is switched on
    My tomato plants have brown spots on the leaves
    My cakes sink in the middle as they cool
    My smoke alarm beeps every few minutes
    My dishwasher leaves a white film on glasses
    My front door sticks in wet weather
    My wooden floor squeaks in one spot
    My sourdough starter has stopped rising
    My lawn has bare brown patches
    My guitar sounds out of tune even right after tuning
    My tumble dryer takes hours to dry a load
    My phone will not charge unless the cable is held at an angle
    My laptop overheats and shuts down during video calls
    My headphones only play sound in one ear
    My email keeps going to people's spam folders
    My spreadsheet formulas show errors after I copied them
    My website loads slowly on phones
    My bathroom mirror fogs up and the room smells damp
    There is black mould on my bedroom windowsill
    My electricity bill has doubled since last year
    My car will not start on cold mornings
    My bike tyre goes flat every few days
    My boiler keeps losing pressure
    My oven cooks unevenly
    My dog pulls hard on the lead
    My cat has started scratching the sofa
    My puppy cries all night in its crate
    My chickens have stopped laying eggs
    My compost heap smells bad
    My apple tree produces lots of flowers but little fruit
    My basil plant keeps wilting
    My jam did not set
    My rice always turns out sticky
    My homemade pizza base is soggy
    My coffee tastes bitter
    My smart speaker keeps mishearing me
    My video calls freeze every few minutes
    My computer makes a clicking noise
    My photos come out blurry indoors
    My kitchen knives go blunt quickly
    My garden pond has turned green
    My patio is slippery with moss
    My sleep has been poor since I started working from home
    My running pace has stopped improving
    My knees ache after cycling
    My team's meetings always overrun
    My small online shop gets visitors but no sales
    My monthly budget never adds up at the end of the month
    My house plants attract tiny flies
    My windows rattle in the wind
    My freezer keeps icing up
    My microwave sparks when it runs
    My TV remote only works up close
    My game console is very loud
    My car's air conditioning blows warm air
    My electric scooter's range has dropped
    My sewing machine keeps skipping stitches
    My knitting has uneven tension
    My watercolour paintings look muddy
    My houseplants grow long and leggy
    My seedlings fall over soon after sprouting
    My hens keep escaping from their run
    My fish tank water is cloudy
    My paint is peeling off the bathroom ceiling
    My gutters overflow when it rains
    My garden shed leaks
    My shoes smell even after washing
    My white shirts have turned grey in the wash
    My wool jumper has gone bobbly
    My laptop keyboard has a sticky key
    My phone storage is always full
    My passwords are a mess and I keep getting locked out
    My child's tablet keeps running out of storage
    My family calendar is chaotic and we miss appointments
    My inbox has thousands of unread emails
    My garage door opener stopped working
    My hedge has bare patches at the bottom
    My bread maker loaf collapses in the middle
    My pressure cooker will not come up to pressure
    My new shoes give me blisters
    My bike gears make a grinding noise
    My car's check engine light came on
    My doorbell camera keeps going offline
    My outdoor lights come on during the day
    My basement smells musty
""")

EVENTS = _lines("""
    a surprise fortieth birthday party
    a neighbourhood street party
    a charity bake sale
    a small garden wedding
    a twenty-year school reunion
    a company summer picnic
    a children's science fair
    the first meeting of a new book club
    a camping weekend for ten friends
    a community litter-pick
    a retirement dinner for a colleague
    a baby shower
    a family reunion spanning three generations
    a fundraising quiz night
    a stall at a farmers' market
    a housewarming party
    a beginners' coding weekend
    a charity five-kilometre fun run
    a children's birthday party at home
    a silver wedding anniversary dinner
    a village summer fete
    a plant swap
    a clothes swap
    a local history exhibition
    a school talent show
    a garden open day for charity
    a board game marathon
    a neighbourhood repair café
    a memorial gathering for a grandparent
    a graduation party
    a welcome event for new neighbours
    a small music festival in a park
    a team away day
    a work leaving party
    an open mic night
    a cycling tour for a club
    a cultural food evening at a community centre
    a dog show for charity
    a poetry reading
    a photography walk
    a wildlife count in a local park
    a family treasure hunt
    a New Year's Eve dinner for twelve
    a harvest supper
    a winter lantern parade
    a picnic concert
    a sports day for a small school
    a gaming tournament for teenagers
    a craft fair
    a second-hand book sale
    a charity sponsored walk
    a cooking class for friends
    a wine and cheese evening
    a film night in a village hall
    a chess tournament for beginners
    a science talk in a pub
    a career fair for school leavers
    a volunteering open day
    a tree-planting day
    a beach clean-up
    a tea party for older neighbours
    a karaoke night
    a first birthday party
    an engagement party
    a hen party that does not involve drinking
    a stag weekend outdoors
    a fancy-dress party
    a seed-sowing day at a community garden
    a festival of lights
    a storytelling evening for children
    a walking tour of a town's history
    a costume ball
    a sports club's annual awards night
    a small business launch party
    a knitting circle's first meet-up
    a family ski trip
    a residents' association meeting
    a cake competition
    a pumpkin carving evening
    a midsummer barbecue
""")

DISHES = _lines("""
    a vegetable lasagne
    a lemon drizzle cake
    a chickpea and spinach curry
    a classic French omelette
    a margherita pizza with home-made dough
    a slow-cooked beef stew
    a mushroom risotto
    a Thai green curry with tofu
    banana bread
    a Greek salad with a simple dressing
    fish tacos with lime slaw
    a shepherd's pie
    pad thai
    a Spanish tortilla
    a red lentil soup
    chocolate chip cookies
    a roast chicken with vegetables
    a vegetable stir-fry with noodles
    scones
    shakshuka
    falafel with tahini sauce
    an apple crumble
    hummus
    a bean chilli
    pancakes for a crowd
    a cheese and leek quiche
    a seafood paella
    a Victoria sponge
    potato gnocchi
    pork and cabbage dumplings
    a Caesar salad
    minestrone
    a tomato sauce for pasta
    a carrot cake
    vegetable spring rolls
    a Moroccan vegetable tagine
    a fish pie
    a beef burger
    a black bean burger
    bread and butter pudding
    a no-bake cheesecake
    a chicken noodle soup
    a ratatouille
    a frittata
    jambalaya
    macaroni cheese
    chilli con carne
    basil pesto
    focaccia
    granola
    overnight oats
    a pumpkin soup
    a lemon tart
    baked salmon with herbs
    miso soup
    ramen with a soft-boiled egg
    bibimbap
    a vegetable biryani
    dal
    naan bread
    chicken tikka masala
    moussaka
    goulash
    pierogi
    borscht
    cinnamon buns
    tiramisu
    pavlova
    brownies
    flapjacks
    rice pudding
    empanadas
    ceviche
    guacamole with baked tortilla chips
    enchiladas
    a vegetable pot pie
    a stuffed butternut squash
    a Sunday roast with all the trimmings
    a Christmas cake
    hot cross buns
""")

DIETS = _lines("""
    vegetarian
    vegan
    high-protein
    low-salt
    dairy-free
    gluten-free
    cheap and filling
    Mediterranean-style
    twenty-minute
    one-pot
    batch-cooked
    child-friendly
""")

HOUSEHOLDS = _lines("""
    a student with one saucepan
    a family of five
    a couple who both work late
    an older person cooking for one
    three flatmates who share a kitchen
    new parents with little time
    a shift worker
    a family with a fussy eater
""")

GOALS = _lines("""
    run my first ten-kilometre race
    swim a mile without stopping
    do ten pull-ups
    pass my driving theory test
    learn the 500 most common words of Spanish
    cycle a hundred kilometres in a day
    hold a plank for three minutes
    walk 10,000 steps a day
    touch my toes
    play a simple piece on the piano
    read twelve novels
    write the first draft of a short novel
    cut down on sugar
    get up an hour earlier
    save enough for a holiday
    pay off a credit card
    learn to draw faces
    improve my chess rating
    climb a famous mountain on a guided walk
    finish a half marathon
    get back into shape after having a baby
    learn to swim as an adult
    speak more confidently in meetings
    learn basic Python
    build a simple app
    pass an introductory accounting exam
    learn to cook twenty dinners from memory
    reduce my screen time
    sleep eight hours a night
    keep a garden going through the summer
    learn to juggle three balls
    do a handstand
    learn to ice skate
    improve my handwriting
    learn to type at sixty words a minute
    learn the basics of photography
    learn to sing in tune
    learn the guitar chords for ten songs
    pass a first-aid course
    get fit enough for a trekking holiday
    lose the habit of snacking at night
    learn to meditate
    prepare for a job interview in a new field
    learn to bake bread without a machine
    declutter my whole home
    become a calmer driver
    learn basic French for a trip
    run five kilometres without walking
    build a habit of journaling
    complete a sprint triathlon
    swim in open water
    learn to knit a jumper
    learn to make pottery on a wheel
    learn to dance for a wedding
    improve my balance
    lift my own body weight in a deadlift
    finish a charity cycle ride
    improve my posture
    learn to read music
    prepare a portfolio for an art course
""")

# Proposals people argue about, each a clause after "the idea that".
CLAIMS = _lines("""
    city centres should be closed to private cars
    primary schools should stop setting homework
    every school should teach personal finance
    voting should be compulsory
    the voting age should be lowered to sixteen
    public transport should be free for everyone
    zoos do more good than harm
    school uniforms should be abolished
    the school day should start later for teenagers
    tourists should pay a nightly tax in popular cities
    single-use plastic bags should be banned
    every adult should learn first aid
    university education should be free
    employers should offer a four-day working week
    advertising junk food to children should be banned
    children under twelve should not own smartphones
    national service should be reintroduced for young people
    museums should be free to enter
    public libraries are more important than ever
    cities should plant a tree for every child born
    remote work is better for most office workers
    tipping in restaurants should be replaced by higher wages
    professional athletes are paid too much
    video games can be a form of art
    space exploration is worth its cost
    cash should be kept alongside digital payments
    every home should have a smart meter
    towns should build more cycle lanes even if it means fewer parking spaces
    handwriting should still be taught in schools
    learning a second language should be compulsory until eighteen
    schools should teach coding from the age of seven
    exams are a poor way to measure what students know
    grades should be replaced by written feedback in primary school
    retirement ages should rise as life expectancy rises
    a universal basic income would be good for society
    the minimum wage should be raised significantly
    zero-hours contracts should be banned
    large companies should publish the gap between their highest and lowest pay
    social media platforms should verify the age of every user
    news websites should not be allowed to hide articles behind paywalls
    celebrities have a duty to be role models
    reality television does more harm than good
    animals should not be used in circuses
    hunting for sport should be banned
    cities should ban fireworks displays by private individuals
    parents should be fined when children skip school
    sugary drinks should carry a health warning
    fast-food outlets should not open near schools
    organ donation should be opt-out
    governments should fund the arts
    professional sport should have salary caps
    historical statues of controversial figures should be moved to museums
    streets should be named after local people rather than national figures
    daylight saving time should be abolished
    every town should have a community garden
    dogs should be banned from public beaches in summer
    cats should be kept indoors to protect wildlife
    meat should be taxed like tobacco
    homes should not be left empty while people are homeless
    second homes in holiday villages should pay double council tax
    rents should be capped in big cities
    new buildings should be required to have solar panels on the roof
    airports should not be allowed to expand
    short-haul flights should be replaced by trains where possible
    cruise ships should be banned from small historic ports
    car advertising should be restricted like tobacco advertising
    speed limits in towns should be 20 miles an hour
    driving tests should be retaken every ten years
    older drivers should have regular eyesight checks
    electric scooters should be allowed on cycle paths
    motorways should have lanes reserved for shared cars
    companies should be required to repair rather than replace faulty goods
    phones should be built so their batteries can be replaced at home
    plastic toys should carry an environmental rating
    fashion brands should be responsible for recycling their clothes
    supermarkets should give unsold food to charities
    food waste should be collected separately from every home
    gardens should be left partly wild to help insects
    artificial grass should be discouraged
    pesticides should be banned in public parks
    wild animals should not be kept as pets
    aquariums should stop keeping dolphins
    children should learn to swim at school
    physical education should be graded like other subjects
    competitive sport in schools does more good than harm
    children should be allowed to walk to school alone from the age of nine
    schools should ban phones during the day
    every child should learn a musical instrument
    homework clubs should replace homework
    schools should teach cooking as a core subject
    classrooms should have no more than twenty pupils
    teachers should be paid as much as doctors
    gap years are valuable for young people
    apprenticeships deserve the same status as degrees
    companies should not ask for degrees for jobs that do not need them
    unpaid internships should be banned
    workers should have the right to switch off outside working hours
    open-plan offices do more harm than good
    meetings should be limited to thirty minutes
    working from a café is better than working from home
    the weekend should be three days long
    shops should close on one day of the week
    public holidays should be moved to Mondays
    cities should have more public toilets
    every neighbourhood should have a shared tool library
    children should be paid for doing household chores
    pocket money should be linked to saving
    parents should limit how much time teenagers spend gaming
    teenagers should be allowed part-time jobs from fourteen
    families should eat dinner together every day
    grandparents should be paid for looking after grandchildren
    paternity leave should be as long as maternity leave
    the working week should be shorter for parents of young children
    towns should invest in youth clubs
    skate parks are a good use of public money
    street art should be protected rather than cleaned off
    busking should be allowed anywhere in a city centre
    town centres should turn empty shops into homes
    online shopping should carry a delivery tax to support high streets
    loyalty cards collect too much personal data
    facial recognition cameras should not be used in public places
    people should be able to delete everything a company knows about them
    a week without the internet every year would do everyone good
    libraries should lend tools and equipment as well as books
    book prizes should have a category for self-published writers
    schools should study modern novels rather than classics
    poetry should be read aloud in every classroom
    films should be shown in schools as part of literature lessons
    museums should return objects taken during colonial times
    ancient ruins should be rebuilt for visitors
    historic buildings should be allowed modern extensions
    towns should limit the number of holiday rentals
    mountain paths should have daily visitor limits
    beaches should be free of commercial development
    national parks should charge entry fees
    rivers should be given legal rights
    every home should collect rainwater
    lawns should be replaced by wildflower meadows
    cities should be designed so everything is within fifteen minutes' walk
    car-free days should be held once a month in every city
""")

# Two options to weigh against each other.
CHOICES = _pairs("""
    renting a flat | buying a house
    going to university | starting an apprenticeship
    an induction hob | a gas hob
    a laptop | a desktop computer
    an electric car | a petrol car
    a hybrid car | a fully electric car
    taking the train | flying for a 600-kilometre journey
    a dog | a cat as a first pet
    living in a city | living in the countryside
    working for a large company | working for a start-up
    freelancing | a salaried job
    learning the piano | learning the guitar
    running | swimming for general fitness
    a gym membership | exercising at home
    an e-reader | paper books
    streaming music | buying records
    cooking from scratch | meal kits
    a fixed-rate mortgage | a variable-rate mortgage
    saving in a bank account | investing in an index fund
    paying off debt early | saving for an emergency fund
    a camping holiday | a hotel holiday
    a package holiday | planning a trip independently
    a cruise | a rail tour
    public school | home schooling
    a big wedding | a small wedding
    a city break | a beach holiday
    a heat pump | a gas boiler
    solid wood furniture | flat-pack furniture
    a robot vacuum cleaner | an ordinary vacuum cleaner
    a smartwatch | a fitness band
    an online degree | studying on campus
    a language app | a language class
    private tutoring | group classes
    a standing desk | a regular desk
    hardwood floors | carpet
    a shower | a bath
    a real Christmas tree | an artificial one
    a wood-burning stove | an electric fire
    a compact camera | a phone camera
    a cargo bike | a second car
    a folding bike | a scooter for commuting
    leasing a car | buying a used car
    working four long days | working five normal days
    a part-time master's degree | a full-time master's degree
    a career in teaching | a career in nursing
    moving abroad for work | staying near family
    retiring early | working a few more years
    downsizing to a smaller home | staying in the family home
    a retirement flat | adapting the current home
    adopting a rescue dog | buying a puppy from a breeder
    a vegetarian diet | a flexitarian diet
    tap water | bottled water
    coffee | tea as a daily drink
    a paper planner | a calendar app
    a shared flat | living alone
    a long commute to a cheaper home | a short commute to a more expensive one
    a big family car | a small car and occasional rentals
    a home office | a co-working space
    a dishwasher | washing up by hand
    a tumble dryer | drying clothes on a line
    an allotment | a few raised beds in the garden
    a wedding abroad | a wedding at home
    a gap year | going straight to university
    a subscription box | shopping as needed
    a smart speaker | an ordinary radio
    a family tablet | a family computer
    a new phone | repairing an old phone
    contact lenses | glasses
    a shared holiday with friends | a holiday with just my partner
    a fountain pen | a ballpoint pen for everyday writing
    a cast-iron pan | a non-stick pan
    a pressure cooker | a slow cooker
    an air fryer | an oven
    a rice cooker | cooking rice in a pan
    a loft conversion | an extension
    an open-plan kitchen | a separate kitchen
    a walk-in shower | a bathtub in a small bathroom
    a hardback notebook | a note-taking app
    renting tools | buying tools
    hiring a builder | doing the work myself
    self-publishing a book | looking for a publisher
    a small wedding now | a larger wedding in two years
    a family road trip | flying to one destination
    visiting one country slowly | seeing several countries quickly
    a cottage in the mountains | a flat by the sea for a holiday
    a tent | a campervan
    a road bike | a hybrid bike
    a treadmill | an exercise bike
    yoga | pilates
    a personal trainer | a group fitness class
    a summer camp | a family holiday for a ten-year-old
    a music festival | a concert hall series
    a long weekend away | several day trips
    a degree in history | a degree in computing
    a career in law | a career in accounting
    learning Spanish | learning Mandarin
    a bilingual school | a local school
    piano lessons | football training for a seven-year-old
    a child's first phone | a smartwatch for children
    homemade baby food | ready-made baby food
    a stay-at-home parent | both parents working part-time
    a childminder | a nursery
    a pet rabbit | a pet guinea pig
    an aquarium | a terrarium
    a vegetable garden | a flower garden
    a lawn | a gravel garden
    a hedge | a fence
    an electric lawnmower | a push mower
    solar panels | a green energy tariff
    double glazing | secondary glazing
    a credit card | a debit card for everyday spending
    a joint bank account | separate accounts for a couple
    a paper map | a navigation app on a hike
    booking early | booking last-minute
    travel insurance per trip | annual travel insurance
    a hostel | an apartment rental
    volunteering abroad | volunteering locally
""")

# What the person written to is going through, after "who".
SITUATIONS = _lines("""
    is about to start university in a city far from home
    has just become a parent for the first time
    is starting their first full-time job
    has been made redundant after twenty years with one company
    is moving abroad on their own
    is nervous about learning to drive at forty
    has just retired and feels a little lost
    is thinking of leaving a steady job to start a business
    has failed an important exam
    is caring for a parent with dementia
    is training for their first marathon
    has just moved in with a partner
    is struggling to make friends in a new town
    is going through a painful break-up
    wants to change careers but fears it is too late
    has been offered a promotion they are unsure about
    is starting secondary school next month
    is the first in their family to go to university
    is buying their first home
    is planning their wedding and feeling overwhelmed
    has been diagnosed with a long-term illness
    has lost a close friend
    is about to become a step-parent
    is taking a gap year
    wants to learn an instrument in their fifties
    is starting a new job as a team manager
    is working night shifts and finding it hard
    has a teenager who has stopped talking to them
    is dealing with a difficult neighbour
    is returning to work after parental leave
    is the youngest person in their office
    is worried about money after an unexpected bill
    is sitting final exams next summer
    wants to get fit after years of inactivity
    is feeling burnt out at work
    has just adopted a rescue dog
    is moving back in with their parents
    is leaving the armed forces for civilian life
    is starting a PhD
    is becoming a grandparent for the first time
    wants to write a novel but never finishes anything
    is nervous about a first solo trip abroad
    has been asked to give a speech at a wedding
    has been elected to lead a local club
    is going to live in a shared house for the first time
    wants to stop comparing themselves to others online
    has fallen out with their oldest friend
    is starting to volunteer at a hospice
    is coaching a children's football team for the first time
    is learning to live on a tight budget
    wants to speak up more at work
    is starting therapy for the first time
    has just moved to a country where they do not speak the language
    is applying for jobs after a long illness
    is taking over the family business
    is going to be a bridesmaid and dreads the attention
    has just bought an old house that needs a lot of work
    is about to run their first half marathon
    is thinking of going back to education at fifty
    is the new captain of a sports team
    is trying to cut down on drinking
    has started a small online shop that is not selling
    is moving to a farm to grow food
    has been accepted to art school
    is working abroad and feeling homesick
    is juggling two part-time jobs
    is about to have twins
    wants to learn to cook properly
    is nervous about a medical operation
    has just become a carer for their partner
    is being bullied at work
    is the only person in their team who works remotely
    is starting a new school in the middle of the year
    has a younger sibling who looks up to them
    wants to take a year off to travel but feels guilty
    is graduating with no idea what to do next
    is about to start an apprenticeship as an electrician
    has a dream of opening a café
    is starting a new life after divorce
    has been asked to mentor a new colleague
    wants to become a teacher after a career in business
    is learning to manage their anxiety
    is saving for a deposit on a flat
    has just finished treatment and is returning to normal life
    is being pressured to follow the career their parents chose
    is struggling with a long commute
    is a new volunteer firefighter
    has been chosen to represent their school in a competition
    has been rejected by every university they applied to
    is about to start nursing school
    has just joined a band
    has taken up running to cope with grief
    is moving into a care home
    wants to leave a city job for a quieter life
    is afraid of public failure after a bad performance
    is about to go on stage for the first time
    is starting to date again after many years
    is helping to raise a grandchild
    is setting up a community garden
    has been told they need glasses and feels self-conscious
    is finding it hard to balance study and a part-time job
    has just been promoted above their friends
    is handing over a business they built to someone else
    wants to learn to swim as an adult
    is going to study abroad for a year
    is thinking of moving to the countryside
    has just finished writing their first book
    is struggling to keep a plant alive and feels silly about it
    wants to reconnect with a sibling they have not spoken to in years
    is preparing for a career in professional sport
    has been asked to lead a school trip
    is taking care of a new kitten
    is writing wedding vows
    has won a scholarship and feels like an impostor
    is about to open their first restaurant
    is nervous about turning thirty
    is about to become an older brother
    is about to become an older sister
""")

# A professional and what a client tells them, in the client's words.
CONSULTATIONS = _pairs("""
    a family doctor | I keep waking at four in the morning and cannot get back to sleep.
    a family doctor | I get a headache most afternoons at work.
    a family doctor | I have had a dry cough for three weeks and it will not go away.
    a family doctor | My energy has been low for months and I do not know why.
    a family doctor | I want to start exercising but I have not done any sport in twenty years.
    a pharmacist | I take several medicines and keep forgetting which to take when.
    a pharmacist | My hay fever tablets make me drowsy. Is there anything else I could try?
    a pharmacist | What should I keep in a first-aid box for a family with small children?
    a pharmacist | I am travelling abroad for a month. How do I manage my prescriptions?
    a pharmacist | My elderly father takes a lot of tablets. How can we keep track of them?
    a physiotherapist | My lower back hurts after a day at my desk.
    a physiotherapist | I sprained my ankle a month ago and it still feels weak.
    a physiotherapist | My knee aches when I go down stairs.
    a physiotherapist | I have a stiff neck every morning.
    a physiotherapist | I want to get back to running after a hamstring injury.
    a dentist | My teeth have become sensitive to cold drinks.
    a dentist | My gums bleed when I brush.
    a dentist | My child is scared of coming to the dentist.
    a dentist | I grind my teeth at night.
    a dentist | Is an electric toothbrush really better than a manual one?
    a dietitian | I want to eat more healthily but I have no time to cook.
    a dietitian | My teenage son only eats pasta and chicken nuggets.
    a dietitian | I have just gone vegan and worry about missing nutrients.
    a dietitian | I always feel hungry an hour after breakfast.
    a dietitian | I train for triathlons. What should I eat on long training days?
    a personal trainer | I have an hour three times a week. How should I use it?
    a personal trainer | I have been going to the gym for a year and stopped making progress.
    a personal trainer | I am sixty-five and want to get stronger safely.
    a personal trainer | I get bored of exercise after a few weeks.
    a personal trainer | I want to do my first pull-up.
    a vet | My dog has started eating grass and being sick.
    a vet | My cat drinks much more water than she used to.
    a vet | We want to get a rabbit. What do we need to know?
    a vet | My old dog is getting stiff in the mornings.
    a vet | How often should my indoor cat be checked?
    a dog trainer | My dog barks at every person who walks past the window.
    a dog trainer | My puppy bites our hands when we play.
    a dog trainer | My dog will not come back when called at the park.
    a dog trainer | My rescue dog is frightened of men.
    a dog trainer | My dog pulls towards every other dog on walks.
    a financial adviser | I am thirty and have never saved for retirement.
    a financial adviser | I have inherited some money and do not know what to do with it.
    a financial adviser | Should I pay off my student loan faster or invest?
    a financial adviser | My income changes a lot from month to month as a freelancer.
    a financial adviser | We want to start saving for our children's future.
    an accountant | I have just started freelancing. What records should I keep?
    an accountant | My small café made a profit but I have no cash. How is that possible?
    an accountant | Should I register my small business as a company?
    an accountant | What expenses can a home worker usually claim?
    an accountant | I am selling handmade jewellery online. When do I need to declare it?
    an employment lawyer | My employer wants to change my contract to fewer hours.
    an employment lawyer | I was told off for something I posted on my private social media.
    an employment lawyer | I think I was passed over for promotion because I am pregnant.
    an employment lawyer | My manager keeps calling me on my days off.
    an employment lawyer | I am being asked to sign a non-compete agreement.
    a housing adviser | My landlord has not fixed the heating for two months.
    a housing adviser | My landlord wants to keep my whole deposit for minor wear and tear.
    a housing adviser | I cannot afford my rent after a pay cut.
    a housing adviser | My neighbours are noisy every night.
    a housing adviser | I want to rent out my spare room. What should I think about?
    a careers coach | I have been a teacher for ten years and want to try something else.
    a careers coach | I have applied for fifty jobs and had no interviews.
    a careers coach | I am good at my job but I do not enjoy it.
    a careers coach | I want to return to work after eight years at home with my children.
    a careers coach | I have two job offers and cannot decide.
    a primary school teacher | My son says he hates reading.
    a primary school teacher | My daughter is anxious about starting school.
    a primary school teacher | How can I help my child with maths when I struggle with it myself?
    a primary school teacher | My child finishes work quickly and then gets bored and disruptive.
    a primary school teacher | My twins are in the same class and always compared.
    a child psychologist | My four-year-old has tantrums every evening.
    a child psychologist | My ten-year-old is being left out by her friends.
    a child psychologist | My son is obsessed with one video game.
    a child psychologist | Our family is moving house and the children are upset.
    a child psychologist | My teenager will not talk about how school is going.
    a speech and language therapist | My three-year-old says very few words.
    a speech and language therapist | My son stammers when he is excited.
    a speech and language therapist | My father's speech changed after his stroke.
    a speech and language therapist | My daughter mixes up some sounds when she talks.
    a speech and language therapist | We speak two languages at home. Will that confuse our baby?
    an architect | We want to make our small terraced house feel bigger.
    an architect | We are thinking of converting our loft.
    an architect | How can we make our house cheaper to heat?
    an architect | We want to build a garden studio to work from.
    an architect | Our kitchen is dark. How can we get more light in?
    an electrician | My lights flicker when the washing machine is on.
    an electrician | A socket in my kitchen feels warm.
    an electrician | We want to install a charger for an electric car.
    an electrician | My fuse box keeps tripping.
    an electrician | We are renovating an old house. What should we check?
    a plumber | Our hot water runs out very quickly.
    a plumber | There is a damp patch on the ceiling below our bathroom.
    a plumber | Our pipes bang when a tap is turned off.
    a plumber | We want to move the kitchen sink to the other side of the room.
    a plumber | Our outdoor tap froze last winter.
    a garden designer | Our garden is long and narrow and feels like a corridor.
    a garden designer | We want a garden that needs very little maintenance.
    a garden designer | Our garden is in shade for most of the day.
    a garden designer | We want to attract more wildlife to a small garden.
    a garden designer | Our children need space to play but we also want flowers.
    an interior designer | Our living room feels cold and unwelcoming.
    an interior designer | We have a tiny flat and too many things.
    an interior designer | How do I choose colours that go together?
    an interior designer | We work from home and our dining table has become the office.
    an interior designer | We want to redecorate a child's bedroom so it grows with them.
    a travel agent | We want a holiday with a toddler that is relaxing for us too.
    a travel agent | I want to travel alone for the first time. Where should I start?
    a travel agent | We have two weeks and a modest budget. Where should we go?
    a travel agent | My elderly mother wants one last big trip.
    a travel agent | We want a holiday that does not involve flying.
    a wedding planner | We have a small budget and a big family.
    a wedding planner | We want an outdoor wedding but worry about the weather.
    a wedding planner | Our families have different traditions.
    a wedding planner | We have only four months to plan everything.
    a wedding planner | How do we keep the wedding relaxed for guests with children?
    a chef | My dinner parties are always stressful.
    a chef | How do I cook for guests with many different allergies?
    a chef | My knife skills are slow and clumsy.
    a chef | I want to cook more vegetables but find them boring.
    a chef | How can I make restaurant-quality sauces at home?
    a librarian | My child has read every book in a series and wants something similar.
    a librarian | I want to research my family history. Where do I begin?
    a librarian | Our book club keeps choosing books nobody finishes.
    a librarian | I want to read more but struggle to concentrate.
    a librarian | How can I tell whether a website is a reliable source?
    an IT support technician | My computer asks me to update every day. Do I have to?
    an IT support technician | I clicked a link in a suspicious email.
    an IT support technician | Our small office shares one password for everything.
    an IT support technician | My parents need a simple setup for video calls.
    an IT support technician | How should our family back up our files?
    a marketing consultant | My bakery has loyal customers but no new ones.
    a marketing consultant | I run a small yoga studio. Is social media worth the effort?
    a marketing consultant | My handmade soap brand looks like everyone else's.
    a marketing consultant | How do I get local press to notice my business?
    a marketing consultant | I have no budget for advertising at all.
    a small-business adviser | I want to turn my weekend baking into a business.
    a small-business adviser | My shop's sales are falling since a supermarket opened nearby.
    a small-business adviser | I cannot decide whether to hire my first employee.
    a small-business adviser | I want to take my market stall online.
    a small-business adviser | My partner and I disagree about where to take our business.
    an estate agent | How do we get our house ready to sell?
    an estate agent | We have had many viewings but no offers.
    an estate agent | What should a first-time buyer look out for at a viewing?
    an estate agent | Should we sell before we find our next home?
    an estate agent | Our house is in a busy road. How do we market it?
    a car mechanic | My car pulls to one side when I drive.
    a car mechanic | How do I know when my tyres need replacing?
    a car mechanic | Is it worth repairing my twelve-year-old car?
    a car mechanic | What should I check before a long road trip?
    a car mechanic | I am buying a used car. What should I look for?
    a bicycle mechanic | My gears do not change smoothly.
    a bicycle mechanic | My brakes squeal when it rains.
    a bicycle mechanic | How do I choose the right size bike?
    a bicycle mechanic | What should I carry on a long ride?
    a bicycle mechanic | My old bike has been in the shed for years. Can it be saved?
    a tailor | My suit jacket is too big in the shoulders.
    a tailor | My favourite jeans have a hole in the knee.
    a tailor | How can I tell if clothes are well made?
    a tailor | I want to alter my mother's wedding dress for my own wedding.
    a tailor | I have a wardrobe full of clothes that do not quite fit.
    a running coach | I want to run my first marathon next year.
    a running coach | I get a stitch every time I run.
    a running coach | I am always injured when I increase my mileage.
    a running coach | How do I run faster over five kilometres?
    a running coach | I find running boring. How do I keep going?
    a music teacher | I am an adult beginner and feel embarrassed to practise.
    a music teacher | My daughter wants to give up the violin after two years.
    a music teacher | I can play the notes but my playing sounds flat and mechanical.
    a music teacher | How much should a child practise each day?
    a music teacher | I get very nervous before performing.
    a language tutor | I have studied Italian for years but freeze when I speak.
    a language tutor | I want to learn Japanese in a year for a work posting.
    a language tutor | I forget new words as quickly as I learn them.
    a language tutor | My accent makes people switch to English when I speak.
    a language tutor | How can I keep up a language I learned at school?
    an optician | My eyes feel tired after a day at the computer.
    an optician | I find it hard to read small print in dim light.
    an optician | My child squints at the board at school.
    an optician | Are blue-light glasses worth buying?
    an optician | I see floaters in my vision from time to time.
    a park ranger | We want to take our children on their first wild camping trip.
    a park ranger | What should we do if we meet a large animal on a trail?
    a park ranger | How can we visit a popular beauty spot without adding to the crowds?
    a park ranger | I found an injured bird on a walk.
    a park ranger | How can a school group help protect a local nature reserve?
    a museum curator | I found an old coin in my garden.
    a museum curator | I have a box of my grandfather's letters from the 1940s.
    a museum curator | How should I look after an old family painting?
    a museum curator | Our village wants to set up a small local history museum.
    a museum curator | How do I find out whether an old object is valuable?
    a beekeeper | I want to keep bees in my back garden.
    a beekeeper | A swarm of bees has settled in my tree.
    a beekeeper | How can I help bees if I do not want to keep them?
    a beekeeper | My neighbours are worried about my new hives.
    a beekeeper | What should I plant to give bees food all year?
    a sleep specialist | My toddler wakes up several times every night.
    a sleep specialist | I work shifts and never feel rested.
    a sleep specialist | I lie awake worrying about work.
    a sleep specialist | My partner snores loudly.
    a sleep specialist | I feel sleepy every afternoon after lunch.
""")

# Jobs with their article, as in "applying to work as ...".
JOBS = _lines("""
    a nurse
    an electrician
    a primary school teacher
    a software developer
    a graphic designer
    a chef
    a pharmacist
    a paramedic
    a firefighter
    a police officer
    a social worker
    a librarian
    an accountant
    a lawyer
    a journalist
    an architect
    a civil engineer
    a mechanical engineer
    a plumber
    a carpenter
    a bricklayer
    a hairdresser
    a barista
    a baker
    a butcher
    a farmer
    a gardener
    a tree surgeon
    a vet
    a veterinary nurse
    a dog groomer
    a zookeeper
    a park ranger
    a museum guide
    a tour guide
    a hotel receptionist
    a flight attendant
    an airline pilot
    a train driver
    a bus driver
    a delivery driver
    a warehouse supervisor
    a shop manager
    a sales assistant
    a call centre adviser
    a customer success manager
    a project manager
    a data analyst
    a web designer
    a cybersecurity analyst
    an IT support technician
    a translator
    a sign language interpreter
    a speech therapist
    an occupational therapist
    a physiotherapist
    a dental nurse
    a dentist
    a midwife
    a care home worker
    a youth worker
    a sports coach
    a personal trainer
    a swimming instructor
    a driving instructor
    a music teacher
    a piano tuner
    a sound engineer
    a film editor
    a photographer
    a wedding planner
    an events manager
    a marketing executive
    a copywriter
    an editor at a publishing house
    a bookseller
    a teaching assistant
    a nursery worker
    a school business manager
    a university lecturer
    a research scientist
    a laboratory technician
    a quality inspector
    a factory operator
    a welder
    a car mechanic
    a bicycle mechanic
    a locksmith
    a window cleaner
    a cleaner
    a caretaker
    a security guard
    a receptionist at a doctor's surgery
    a medical secretary
    a charity fundraiser
    a volunteer coordinator
    a community organiser
    a town planner
    a surveyor
    an estate agent
    a mortgage adviser
    a bank cashier
    an insurance claims handler
    a payroll officer
    a human resources adviser
    a recruiter
    an office manager
    a personal assistant
    a florist
    a tailor
    a potter
    a jeweller
    a furniture restorer
    a picture framer
    a cinema projectionist
    a theatre stage manager
    a costume designer
    an animator
    a game designer
    a radio presenter
    a weather forecaster
""")

APPLICANTS = _lines("""
    a recent graduate
    someone returning to work after a five-year career break
    someone with fifteen years of experience in the role
    someone moving from the same role in another country
    a career changer who has just finished retraining
    an employee of the same company seeking a promotion
    someone whose last employer has closed down
    someone looking for part-time hours
""")

LEAVING_REASONS = _lines("""
    to start their own business
    to move abroad with their family
    to care for a relative
    to go back to full-time study
    to take up a role at another company
    to retire
    because of a long commute
    to take a year off to travel
    to move to a job closer to their children's school
    to change careers
""")

PRODUCTS = _lines("""
    a solar-powered camping lantern
    a set of reusable beeswax food wraps
    a weighted sleep mask
    an ergonomic office chair
    a soil-moisture sensor for houseplants
    a folding electric scooter
    a cast-iron frying pan
    a waterproof children's raincoat
    a stainless-steel water bottle that keeps drinks cold for a day
    a noise-cancelling pair of headphones
    a bamboo cutting board
    a compact espresso machine
    a hand-cranked radio for emergencies
    a smart doorbell with a camera
    a reading light that clips onto a book
    a weekly pill organiser with reminders
    a self-watering window box
    a lightweight hiking backpack
    a collapsible silicone lunch box
    a wooden puzzle for toddlers
    a beginners' watercolour set
    a yoga mat made from natural rubber
    a robot lawnmower
    a bread maker
    a cordless stick vacuum cleaner
    an air purifier for bedrooms
    a portable power bank for camping trips
    a wool blanket woven from recycled fibres
    a desk that converts between sitting and standing
    a recipe book for people who cook for one
    a kit for growing mushrooms at home
    a bird feeder with a built-in camera
    a pair of trail running shoes
    a handmade ceramic teapot
    a child's balance bike
    an electric toothbrush for children
    a set of colour-changing smart bulbs
    a weatherproof Bluetooth speaker
    a journal with prompts for daily reflection
    a subscription box of board games
    a refillable fountain pen
    a slow cooker with a timer
    a heated gilet for winter walks
    a pet camera that dispenses treats
    a cat tree for small flats
    an orthopaedic dog bed
    a compost caddy for the kitchen
    a sourdough starter kit
    a set of kitchen knives for beginners
    a kids' coding robot
    a telescope for young astronomers
    a foldable travel kettle
    an e-reader with a warm front light
    a bicycle helmet with built-in lights
    a packable down jacket
    a hammock that sets up in two minutes
    a portable camping stove
    a set of waterproof walking trousers
    a digital photo frame for grandparents
    a large-button mobile phone for older people
    a magnifying lamp for craft work
    a sewing machine for beginners
    a cordless drill
    a tool kit for first-time homeowners
    a rechargeable hand warmer
    a stand mixer
    a smart scale that tracks body measurements
    a posture-correcting cushion
    a baby carrier designed for hot weather
    a travel cot that folds into a backpack
    a board game about climate change
    a language-learning card game
    a children's atlas with stickers
    a wall planner for busy families
    a pair of blue-light reading glasses
    a fitness band for swimmers
    a waterproof phone case for beach holidays
    a pair of ski goggles that do not fog
    a bike repair kit that fits in a pocket
    a shower head that saves water
    a smart thermostat
    a wood pellet pizza oven for the garden
    a picnic basket for four
    a gardening kneeler that turns into a seat
    a rain barrel for gardens
    a set of raised garden beds
    a worm farm for composting
    a beehive for beginners
    a chess set with a built-in clock
    a jigsaw puzzle of a famous painting
    a personalised storybook for children
    a magnetic building set
    a kit for making candles at home
    a leather wallet made by hand
    a rucksack made from recycled plastic bottles
    a pair of walking poles
    a sleeping bag for cold nights
    a child seat for a bicycle
    a cargo bike for families
    an electric bike for commuting
    a pair of bone-conduction headphones for cyclists
    a smart lock for a front door
    a home security camera
    a baby monitor with a sound machine
    a kids' smartwatch with a call button
    a gaming chair
    a mechanical keyboard
    a portable projector
    a vinyl record player
    a podcast microphone
    a ring light for video calls
    a label maker
    a document scanner
    a paper shredder for home offices
    a stylish umbrella that survives strong wind
    a heated throw for the sofa
    a dehumidifier for damp homes
    a handheld steamer for clothes
    a laundry basket that sorts colours
    a set of vacuum storage bags
    a shoe rack for narrow hallways
    a bathroom shelf that needs no drilling
    a bedside lamp that wakes you with light
    a pillow for side sleepers
    an organic cotton duvet cover
    a baby sleeping bag
    a set of reusable nappies
    a bar of soap made with goat's milk
    a refill service for household cleaning products
    a natural deodorant
    a shampoo bar
    a hiking map app subscription
""")

PRODUCT_PROBLEMS = _lines("""
    arrived three weeks late
    was charged to my card twice
    looks nothing like the photos on the website
    was damaged in delivery
    is much smaller than the listing suggested
    was left with a neighbour without my agreement
    came without the free gift that was advertised
    arrived in far more packaging than it needed
    was cancelled by the shop after I had paid
    cost more at the checkout than the advertised price
    was sent without the gift message I paid for
    came from abroad with customs charges nobody mentioned
""")

BUSINESSES = _lines("""
    an online bookshop
    a furniture delivery company
    a local gym
    a mobile phone provider
    a broadband company
    a small hotel by the sea
    a train company
    a car rental company
    a bicycle repair shop
    a meal-kit delivery service
    a garden centre
    a cinema chain
    a children's activity centre
    a dental practice
    a vet's practice
    a language school
    a travel agency
    a pet food subscription
    a concert venue
    a boutique clothing shop
    a home cleaning service
    a removals company
    a driving school
    a florist
    a bakery that takes custom cake orders
    a photography studio
    a music streaming service
    a museum's online shop
    a ski equipment rental shop
    a coffee subscription
    a dry cleaner
    a print shop
    a theatre box office
    a toy shop
    an electronics repair shop
    a kitchen fitting company
    a window installation company
    a campsite
    a wedding venue
""")

CUSTOMER_ISSUES = _lines("""
    is angry about being charged after cancelling
    was promised a call back that never came
    wants a refund outside the usual refund period
    had an unpleasant experience with a member of staff
    found the website so confusing that they gave up
    is asking for compensation after a long delay
    has been a customer for ten years and is threatening to leave
    wrote to say how much they enjoyed the service
    asks whether their personal details have been shared
    reports the same problem for the third time
""")

# Kinds of places, never a real one.
PLACES = _lines("""
    a coastal fishing village
    a mountain town known for its hiking trails
    a walled medieval city
    a desert oasis town
    a wine-growing valley
    a remote island with one ferry a day
    a lakeside town
    a port city with an old harbour
    a capital city famous for its museums
    a university town
    a national park with hot springs
    a river delta full of birds
    a ski resort
    a small town on a long-distance railway line
    a city built on canals
    a village in rolling farmland
    a cliff-top village
    a rainforest lodge
    a town at the foot of a volcano
    a city of hills and staircases
    a seaside resort past its heyday
    a market town with a weekly cattle fair
    a former mining town turned arts centre
    a city famous for its street food
    a chain of islands with white sand beaches
    a high plateau with nomadic herders
    a northern city under the midnight sun
    a fjord village
    a mountain monastery
    a vineyard estate with a guest house
    a city of modern architecture
    a town famous for its carnival
    a spa town
    a forest cabin retreat
    a riverside city with many bridges
    a tea-growing hill region
    a city with a famous old bazaar
    a wildlife reserve on the savannah
    a glacier valley
    a village of painted houses
    a town on a pilgrimage route
    a small country's capital
    a city known for its music scene
    a surf town
    a town in the heart of cheese country
    a car-free island
    a canyon region with rock formations
    a lighthouse island
    a mountain pass with a hut for walkers
    a harbour town known for shipbuilding
    a border town with two languages
    a town of thermal baths
    a city famous for its gardens
    a historic railway town
    a salt-marsh coast
    a region of lakes and forests
    a city of old trams
    a garden city built in the last century
    a village known for pottery
    a town with a famous astronomical observatory
    a coastal city with a long promenade
    a winter town of frozen lakes
    a river valley of castles
    a seaside town with rock pools
    a mountain village reached by cable car
    a farming island
    a city of night markets
    a bird-watching island
    a town built around a cathedral
    a hill town of olive groves
    a wetland national park
    a coastal path of fishing coves
    a city of cycling lanes
    a historic silk-weaving town
    a frontier town of the old west
    a city built on seven hills
    a valley of hot-air balloons
    a peninsula of sand dunes
    a town of clockmakers
    a city with a world-famous zoo
""")

SEASONS = _lines("""
    spring
    summer
    autumn
    winter
""")

TIMES_OF_DAY = _lines("""
    at dawn
    at midday
    at dusk
    late at night
""")

TRAVELLERS = _lines("""
    a family with two young children
    a couple celebrating an anniversary
    a solo traveller on a tight budget
    a group of university friends
    a retired couple who like to take things slowly
    a wheelchair user and a friend
    a photographer looking for quiet spots
    someone who travels mainly for the food
    a first-time traveller abroad
    two friends who love history
    a business traveller with one free day
    a parent and a teenager
""")

RESTAURANTS = _lines("""
    a family-run noodle bar
    a new vegan bistro
    a seaside fish and chip shop
    a fine-dining restaurant with a tasting menu
    a neighbourhood pizzeria
    a Lebanese mezze restaurant
    a village pub that serves food
    a street-food market hall
    a sushi counter
    a Georgian restaurant
    a Korean barbecue restaurant
    a tapas bar
    a Sunday-brunch café
    a Sri Lankan canteen
    a steakhouse
    a Mexican taqueria
    a dim sum restaurant
    an Ethiopian restaurant
    a Polish bakery café
    a Greek taverna
    a farm shop café
    a hotel restaurant
    a food truck that sells dumplings
    a vegetarian Indian thali restaurant
    a French bistro
    a ramen shop
    a cocktail bar that serves small plates
    a breakfast diner
    a riverside café
    a Vietnamese pho restaurant
    a Turkish grill
    a Caribbean takeaway
    a Peruvian restaurant
    a Moroccan restaurant
    an ice cream parlour
    a cake shop with a tea room
    a museum café
    a zero-waste restaurant
    a burger joint
    a seafood shack
    a Nepalese restaurant
    a Persian restaurant
    a Scandinavian bakery
    a Malaysian hawker-style restaurant
    an Italian deli with a few tables
    a late-night kebab shop
    a Cuban café
    a Basque pintxos bar
    a hot-pot restaurant
    a school-run café on a high street
""")

VISITS = _lines("""
    dinner on a busy Saturday night
    a quiet weekday lunch
    a birthday dinner for six
    ordering a takeaway from it
    a first date there
    a family meal with young children
""")

CHARACTERS = _lines("""
    a retired lighthouse keeper
    a nervous first-year medical student
    a baker in a village she has never left
    a detective afraid of the dark
    a ten-year-old inventor
    an elderly chess champion
    a lonely robot vacuum cleaner
    a night-shift taxi driver
    a shy librarian
    a famous chef with no sense of taste
    a cat convinced she is royalty
    a struggling jazz musician
    a beekeeper with a secret
    a teenage skateboarder
    a marathon-running grandmother
    a ship's cook on a cargo vessel
    a postman on a remote island
    a forgetful wizard
    a retired astronaut
    a young farmer taking over the family farm
    a clockmaker
    a museum night guard
    a dragon afraid of fire
    a girl able to talk to trees
    a boy with a collection of lost things
    a travelling circus acrobat
    a gardener at a grand country house
    a nurse on her last shift before retiring
    an ice-cream seller with a rival across the street
    a mountain rescue volunteer
    a translator at an international summit
    a street musician
    a zookeeper
    an escaped farm goat
    a village blacksmith
    a weather forecaster with a terrible record
    a bus driver on the last route of the night
    a painter obsessed with the sea
    a tailor in a small mountain town
    a school caretaker
    a hotel receptionist
    an Antarctic researcher
    a champion dog groomer
    a lock-keeper on a quiet canal
    a second-hand bookshop owner
    a young ghost with no talent for haunting
    a knight with the heart of a poet
    a seasick pirate
    a deep-sea diver
    an amateur astronomer
    a tortoise with big ambitions
    a fox running a café
    a hedgehog
    a small-town mayor
    a runaway bride
    a wedding photographer
    a piano tuner
    a teenage coder
    a retired spy turned rose grower
    a mapmaker
    a train conductor
    a lighthouse cat
    a firefighter afraid of heights
    a professional sleepwalker
    a mother of triplets
    a dance teacher
    a reluctant superhero
    a goalkeeper before a penalty shoot-out
    a fisherman
    an archaeologist
    a forest ranger
    a toy maker
    a delivery cyclist
    a choir conductor
    a chess-playing robot
    a street food vendor
    a retired circus elephant
    a young queen on her first day
    a lonely scarecrow
    a snowman dreading the spring
""")

# What happens to a character, after "who".
PREDICAMENTS = _lines("""
    finds a letter in a library book that changes everything
    has to cook dinner for a visiting queen
    loses their voice on the day of a big performance
    discovers that their neighbour is secretly famous
    wins a house in a raffle
    gets stuck in a lift with their worst enemy
    is the only one who notices the town clock has stopped
    inherits a rundown cinema
    receives a parcel meant for someone else
    accidentally becomes mayor
    finds a map hidden in the lining of an old coat
    must deliver an urgent message across a frozen lake
    discovers one day that the sea has vanished from their town
    is mistaken for a famous explorer
    has one day to find a lost wedding ring
    befriends a stray dog that seems to understand everything
    starts receiving postcards from a place that does not exist
    is trapped by snow in a mountain hut with strangers
    is asked to judge a baking competition they know nothing about
    finds a door in their house that was not there yesterday
    must teach a grumpy old man to dance
    discovers their plants can talk
    is chosen to carry the torch at a village festival
    has to win back the trust of their best friend
    is given a seed that grows overnight into a giant tree
    is the last person awake on a night train
    answers a phone call meant for a famous actor
    must rescue a kite stuck on a church spire
    accidentally swaps suitcases at an airport
    suddenly finds they can sing like an opera star
    finds a message in a bottle
    has to hide an elephant from the landlord
    gets lost in a city where nobody speaks their language
    must return a library book that is forty years overdue
    is the only witness to a very strange robbery
    promised to climb a mountain before turning sixty
    discovers that the moon has gone missing
    is asked to keep a secret that could save the village
    builds a boat in their back garden
    tries to break a world record
    meets their double on a crowded street
    opens a café in the middle of nowhere
    must find a new home for forty cats
    is the last one left on an island after the ferry leaves
    is challenged to a duel over a cake recipe
    can hear what others are thinking for one day
    finds an injured bird on the doorstep
    has lost the key to the town's treasure chest
    becomes friends with a ghost
    is invited to a party by mistake
    must finish a painting before midnight
    sees a shooting star land in the garden
    has to organise a wedding in a single day
    is the only person who remembers a forgotten song
    must guide a group of tourists through a storm
    finds a baby dragon in the woods
    is given one wish and cannot decide
    keeps finding the same coin in every pocket
    enters a talent show on a dare
    finds that their house has moved to a different town overnight
    has to share a flat with a rival
    discovers a hidden room behind the bookshelves
    must deliver a birthday cake across the city in rush hour
    trains a goat to win the county show
    is left in charge of a lighthouse during a storm
    finds their grandmother's diary and a mystery in it
    is followed home by a friendly cloud
    receives a mysterious invitation to a midnight picnic
    has to return a lost circus lion
    wins a trip to the bottom of the sea
    finds an old camera with one photograph left to take
    is asked to keep bees for a week
    forgets their lines on opening night
    swaps jobs with a stranger for a week
    starts a rumour that gets out of hand
    is given a second chance to say goodbye
    finds a tiny village inside a snow globe
    must get a piano up a hill
    is the last to leave a sinking ship
    becomes the caretaker of a haunted school
""")

CREATURES = _lines("""
    a sleepy owl
    a brave little tugboat
    a teddy bear
    a snail
    a small cloud
    a baby elephant
    a hedgehog
    a penguin
    a tiny dragon
    a kind giant
    a little star
    a rabbit
    a mouse living in a teapot
    a tortoise
    a duckling
    a fox cub
    a puppy
    a kitten
    a ladybird
    a busy bee
    a little red train
    a moon bear
    a seal pup
    a robin
    a friendly monster
    a little boat
    a sleepless sheep
    a baby whale
    a firefly
    a squirrel
    a koala
    a lamb
    a bunny made of snow
    a small green frog
    a lighthouse
    a tree
    a little wind
    a fairy afraid of the dark
    a sloth
    a panda
""")

SMALL_ADVENTURES = _lines("""
    goes looking for the moon's lost shoe
    learns to share a favourite toy
    helps a lost star find its way home
    is scared of the dark until a friend visits
    searches for the softest place to sleep
    plants a seed and waits for it to grow
    counts the stars to fall asleep
    sails across a bath-sized sea
    makes a new friend at the park
    tries to stay awake to see the sunrise
    helps an old friend who is feeling sad
    goes on a picnic in the rain
    builds a house for a family of beetles
    finds the way home by following the river
    tidies up the forest after a storm
    waits for the first snow
    learns to say sorry
    hums a lullaby to the whole forest
    follows a trail of glowing pebbles
    bakes a cake for the moon
    visits grandma on the other side of the hill
    gets a new little sister
    paints the sky with colours
    helps the wind find its whistle
    finds a blanket for a cold caterpillar
    goes to the seaside for the first time
    loses a tooth and waits for the tooth fairy
    is too excited to sleep before a birthday
    learns how the night animals wake up
    helps a mother duck find her ducklings
    makes a wish on a dandelion
    listens to the rain on the roof
    swaps places with a sleepy cat for a night
    tucks all the toys into bed
    goes on a slow walk to the end of the garden
    finds where the rainbow ends
    climbs the tallest hill to say goodnight to the sun
    discovers that the moon is always there
    learns that being small can be a good thing
    gives a gift to everyone in the village
""")

# Morals a fable teaches, after "the moral is that".
MORALS = _lines("""
    kindness to strangers is often repaid
    boasting invites trouble
    a friend in need shows who you really are
    patience can achieve what force cannot
    those who listen learn more than those who talk
    greed can make you lose what you already have
    working together is better than working alone
    honesty is worth more than cleverness
    appearances can deceive
    it is wise to prepare for hard times
    pride comes before a fall
    a small act of courage can change everything
    you should not judge others by their size
    sharing makes a meal go further
    gratitude makes a little feel like a lot
    it is never too late to learn
    a promise should be kept
    jealousy harms the jealous most
    curiosity leads to discovery
    those who help others are helped in return
    rushing often makes a task take longer
    listening to advice can save you
    everyone has a talent of their own
    anger is a poor guide
    the loudest voice is not always right
    a true friend tells you the truth
    trust is easily broken and slowly mended
    you cannot please everyone
    what you give away returns to you
    being different can be a strength
    it is better to try and fail than never to try
    the grass is not always greener elsewhere
    a leader should serve those they lead
    lies grow bigger the longer they are kept
    good things come to those who work for them
    laziness today brings trouble tomorrow
    forgiveness frees the one who forgives
    fear is often bigger than the danger
    one should not count on what one does not yet have
    wisdom often comes from the unexpected
    no one is too small to make a difference
    it pays to think before you speak
    a home is made by those who live in it
    the best gifts cannot be bought
    those who mock others may be mocked in turn
    every voice deserves to be heard
    stubbornness can leave you stranded
    the best way to learn is by doing
    plenty can be lost through carelessness
    a good neighbour is worth more than a distant relative
    slow and careful work lasts longest
    knowing when to stop is a kind of wisdom
    friendship needs looking after like a garden
    quiet people often notice the most
    it is brave to admit a mistake
    helping the weak makes the whole group strong
    you should not borrow what you cannot return
    a clever plan needs a kind heart
    what seems like bad luck can turn out well
    there is strength in asking for help
""")

# Two people, as in "a scene between ...".
PAIRS = _lines("""
    two estranged sisters
    a nervous intern and a gruff head chef
    a grandfather and his teenage grandson
    two rival florists
    a landlady and a tenant who is always late with the rent
    a tired nurse and a talkative patient
    two strangers who share a birthday
    a detective and an honest suspect
    a bride and her overprotective father
    a shop assistant and a customer who is always right
    two old friends who have not met in twenty years
    a teacher and a student who never does homework
    a football coach and a star player who wants to quit
    two astronauts on a long mission
    a celebrity and a fan who does not recognise them
    a robot and the inventor who built it
    two neighbours arguing over a fence
    a job interviewer and an overconfident candidate
    a mother and a daughter planning a surprise
    two siblings clearing out their parents' house
    a ghost and the family who just moved in
    a waiter and a food critic in disguise
    a tour guide and a tourist who knows more than them
    a mayor and a protester
    two children who both claim the same tree house
    a pilot and a nervous first-time flyer
    a poet and a plumber
    a king and his honest court jester
    a new manager and the employee who wanted the job
    a lighthouse keeper and a stranded sailor
    two chess players during a tense final
    a hairdresser and a customer who wants a drastic change
    a police officer and a lost tourist
    a farmer and a city child on holiday
    two musicians forming a band
    a scientist and a sceptical journalist
    a librarian and a noisy student
    a doctor and a hypochondriac
    two spies who used to be friends
    a customer and a talking vending machine
    a babysitter and a very clever six-year-old
    two rival bakers at a village show
    a ticket inspector and a passenger without a ticket
    an author and their harshest critic
    a gardener and a rabbit eating the lettuces
    two elderly friends planning one last adventure
    a wedding planner and an indecisive couple
    two flatmates with very different habits
    a taxi driver and a passenger running late for a wedding
    a museum guard and a statue that comes to life
""")

# Where the two people are, after "They are".
SCENE_SETTINGS = _lines("""
    stuck in a lift that has stopped between floors
    waiting for a delayed train at a tiny rural station
    sharing a table in a crowded café
    locked out of the house in the rain
    lost in a forest at nightfall
    queueing for tickets to a sold-out concert
    sitting next to each other on a long flight
    cleaning up after a party
    stranded at an airport overnight
    painting a fence together
    stuck in traffic on the way to an important event
    trying to assemble flat-pack furniture
    on a first fishing trip together
    preparing a meal for unexpected guests
    waiting for exam results
    camping in a storm
    sharing a hospital waiting room
    hiding from a rainstorm under a bus shelter
    trying to catch an escaped chicken
    sorting through boxes in an attic
    rehearsing for a school play
    stuck on a broken-down bus
    walking a very large dog
    sitting on a park bench at dawn
    decorating a cake for a competition
    driving through the night to reach the coast
    climbing the last hill of a long walk
    waiting for a baby to be born
    trapped in a museum after closing time
    trying to fix a leaking boat
    guarding a stall at a village fair
    selling lemonade on a hot day
    stuck on a ski lift that has stopped
    picking apples in an orchard
    building a snowman in the park
    looking after a neighbour's parrot
    on the night shift at a petrol station
    rowing across a lake
    searching for a lost cat
    watching fireworks from a rooftop
""")

POEM_SUBJECTS = _lines("""
    the first frost of the year
    a grandmother's kitchen
    rain on a tin roof
    an empty playground at night
    the last day of the summer holidays
    a city waking up
    an old dog asleep by the fire
    the sea in winter
    a letter never sent
    the smell of fresh bread
    a train journey at night
    a garden after a storm
    the moon over a quiet town
    a first day at a new school
    the hum of a busy kitchen
    autumn leaves in a gutter
    a lighthouse beam
    a walk in the fog
    the silence after snow
    a pair of worn-out boots
    a friendship that faded
    the view from a mountain top
    a busy railway station
    a child learning to ride a bike
    the sound of a cello
    a beach at low tide
    a birthday candle
    moving out of a childhood home
    a field of sunflowers
    the night sky in the desert
    a spider's web with dew on it
    an old photograph
    a cup of tea on a cold morning
    the first swallow of spring
    a street market closing for the night
    a river running to the sea
    a hospital waiting room
    a library at closing time
    the smell of cut grass
    a long-distance friendship
    a kite caught in a tree
    an abandoned bicycle
    a fisherman at dawn
    the last bus home
    a power cut on a winter evening
    a snail crossing a path
    the colour blue
    a family dinner table
    a lost glove on a railing
    the courage to start again
    a lullaby sung by a father
    a forest in autumn
    a thunderstorm in summer
    the ticking of a clock
    a paper boat on a puddle
    a market in the rain
    a garden shed
    the first cup of coffee
    a bus window on a rainy day
    the end of a long war
    the joy of dancing badly
    a cat watching birds
    an old tree in a city square
    the taste of a ripe plum
    waiting for someone at an airport
    the hour before dawn
    a house full of guests
    a quiet Sunday afternoon
    a harbour at night
    the night before an exam
    the patience of a gardener
    a mother's hands
    a broken umbrella
    an orchard in blossom
    the stars over a campsite
    a brother far away
    an empty stage after a show
    bees in a lavender bush
    a bonfire on a beach
    a map of a place you have never been
    the sound of a distant train
    a wedding in the rain
    a neighbour's piano heard through the wall
    a bowl of soup on a sick day
    a winter allotment
    a bridge in the mist
    the last light on a hill
    a wool jumper knitted by hand
    a drawer of old keys
    a school bell
    a dog waiting at the door
    the first warm day of the year
    an owl in the dark
    fireworks over a river
    a snowball fight
    a treehouse
    a city from a plane window
    the morning after a storm
    learning a new language
    an unexpected kindness
""")

POEM_FORMS = _lines("""
    a sonnet
    a sequence of five haiku
    a free-verse poem
    a limerick
    a ballad
    a villanelle
    a poem in rhyming couplets
    a prose poem
    an ode
    a short poem in three stanzas
""")

SONG_KINDS = _lines("""
    a folk song
    a country ballad
    a sea shanty
    a pop song
    a slow blues
    a lullaby
    a punk anthem
    a gospel-style song
    a reggae tune
    a jazz ballad
    a hip-hop track
    a children's singalong
""")

OCCASIONS = _lines("""
    a toast at my best friend's wedding
    the opening of a new community garden
    a retirement party for a school caretaker after thirty years
    welcoming new students on their first day at college
    accepting a volunteering award from the town council
    a eulogy for a grandfather who loved fishing
    the launch of a small charity for homeless pets
    my sister's fortieth birthday dinner
    the final night of a summer camp
    a farewell for a colleague moving abroad
    a school prize-giving evening
    the first meeting of a new residents' association
    the reopening of a village library
    a sports club's end-of-season dinner
    thanking volunteers after a flood clean-up
    a toast at my parents' golden wedding anniversary
    the start of a charity fun run
    a leaving assembly for a head teacher
    the opening of a small art exhibition
    the naming ceremony for a new lifeboat
    a welcome for refugees at a community centre
    a company's twenty-fifth anniversary
    a best man's speech at my brother's wedding
    a maid of honour's speech at my cousin's wedding
    the unveiling of a memorial bench
    the opening night of a school play
    a team meeting after losing a big client
    the first day of a coding bootcamp
    a rally for a new cycle lane
    a speech to persuade the council to save a swimming pool
    the graduation of a nursing class
    a tribute to a retiring football coach
    the end of a year-long community project
    a memorial service for a much-loved teacher
    the launch of a neighbourhood food bank
    welcoming guests to a family reunion
    opening a conference on rural life
    a thank-you to the staff of a hospital ward
    a speech as the new captain of a rowing club
    a fundraising dinner for a children's hospice
    an awards night for local businesses
    the first day of a new job as head of a team
    accepting a lifetime achievement award in gardening
    a Christmas party for a small company
    a tree-planting ceremony
    a speech at my own retirement party
    the christening of a friend's baby
    introducing the main speaker at a book festival
    the opening of a new playground
    a leaving party for a friend going to university
    the closing of a much-loved village shop
    a charity auction
    the reopening of a restored steam railway
    a speech to a youth orchestra before its first tour
    the anniversary of a town's twinning with a town abroad
    a memorial for a beloved family dog, among friends
    a welcome evening for new choir members
    a toast at a housewarming
    thanking parents at the end of a school year
    motivating a team before a sponsored walk
    a talk to scouts about a life outdoors
    the dedication of a new community kitchen
    a speech at a hundredth birthday party
    the end of a long renovation of a village hall
    the prize-giving of a baking competition
    thanking a surgeon's team after a successful operation
    the launch of a local newspaper
    welcoming delegates to a beekeeping convention
    a toast at a friend's citizenship celebration
    the start of a school's science week
    saying goodbye to a neighbour of forty years
    the first rehearsal of a community theatre group
    a speech to open a food festival
    a father-of-the-bride speech
    a mother-of-the-groom speech
    a speech for a friend's book launch
    a pep talk before a debating final
    honouring a lifeguard's rescue
    a speech at an allotment society's annual show
    the opening of a new bridge for walkers
""")

# Whom the email is to and what it asks, after "an email to".
REQUESTS = _lines("""
    my manager asking to work from home two days a week
    my landlord asking for a leaking roof to be repaired before winter
    a neighbour asking them to trim a hedge that blocks the pavement
    my child's teacher asking for a meeting about homework
    a local business asking them to sponsor a charity run
    a former professor asking for a reference
    my team asking them to fill in a short survey
    a supplier asking for a delivery to be brought forward
    the council asking for a broken streetlight to be fixed
    a hotel asking for a late check-out
    a venue asking whether a date in June is available
    a colleague asking them to swap shifts
    my manager asking for a training course to be paid for
    a client asking for an overdue invoice to be paid
    a journalist asking them to correct an error in an article
    a museum asking permission to use a photograph in a book
    a well-known author asking them to speak at a school
    my gym asking to pause my membership for three months
    a university asking for an extension to a deadline
    a new neighbour inviting them to a street party
    an estate agent asking to view a flat this weekend
    my bank asking them to reverse a fee
    an airline asking for a refund for a cancelled flight
    a conference organiser offering to give a talk
    a local radio station asking them to announce a charity event
    a software company asking for a discount for a charity
    my manager asking for a day off for a family event
    an old friend suggesting we meet after ten years
    a recruiter asking for feedback after an unsuccessful interview
    a bookshop asking them to stock my self-published book
    a school asking to visit before applying
    a sports club asking whether my son can try a session
    my doctor's surgery asking for a copy of my records
    a parent of my child's friend arranging a play date
    a company asking for a job shadowing day
    a photographer asking for a quote for a small wedding
    a catering company asking for a vegetarian menu
    a charity asking how to volunteer at weekends
    the organiser of a market asking for a stall
    a famous chef asking for a recipe for a school project
    a landlord asking permission to keep a cat
    a colleague asking them to review a document by Friday
    the head of a department asking to join a project
    a venue asking them to improve wheelchair access
    a building manager asking for bicycle storage
    a garden centre asking them to donate plants to a school
    an expert asking for an interview for a student newspaper
    a local café asking them to host an art exhibition
    a plumber asking for a quote for a new bathroom
    a manager asking for flexible hours during exams
    a course leader asking to join a full class
    a former colleague asking for an introduction to their company
    the council asking for a bench at a bus stop
    a record shop asking them to host a small concert
    a tour company asking for a group discount
    a translator asking for a quote for a short document
    a scientist asking them to visit a school science club
    a football club asking to use their pitch for a charity match
    a publisher asking whether they accept unsolicited manuscripts
    a hotel asking them to store luggage for a day
    my neighbour asking them to keep their dog quiet at night
    a restaurant asking to book a private room for twenty
    a mentor asking for advice on a career move
    a council asking for a pedestrian crossing near a school
    an orchestra asking whether students get cheap tickets
    a newspaper asking them to cover a community event
    a family member asking to borrow their car for a week
    a local artist commissioning a painting of our house
    a travel agent asking for changes to a booking
    a headteacher asking for a school trip to be approved
    a cycling club asking how to join
    an employer asking to defer a start date
    an expert asking for feedback on a business idea
    my landlord asking to redecorate my room
    a childminder asking whether they have a place in September
    a car dealer asking for a test drive
    a theatre asking about accessible seats
    a library asking them to hold a reading group
    a wildlife trust asking for advice on a garden pond
    a builder asking for a start date
""")

# Whom the note thanks and for what, after "a thank-you note to".
THANKS = _lines("""
    a neighbour who looked after my cat for two weeks
    a teacher who helped my son through a hard year
    a nurse who cared for my mother in hospital
    a friend who helped me move house in the rain
    a stranger who returned my lost wallet
    a colleague who covered my work while I was ill
    my driving instructor after I passed my test
    a mentor who helped me get my first job
    my grandparents for a generous birthday present
    the hosts of a wonderful dinner party
    a coach who believed in me
    a doctor who spotted something others missed
    the volunteers at a food bank
    a friend who drove me to an early flight
    my aunt who knitted a blanket for our baby
    a shop assistant who went out of their way to help
    a landlord who fixed the boiler on a Sunday
    a family who hosted me during a year abroad
    a former boss who wrote me a strong reference
    a stranger who helped when my car broke down
    a neighbour who shovelled snow from my path
    a school's staff at the end of my child's final year
    a friend who listened during a difficult time
    my brother who lent me money when I needed it
    a librarian who helped with my research
    the paramedics who came when my father fell
    a piano teacher of ten years
    my team after a successful project
    a friend who organised my surprise party
    the wedding guests who travelled a long way
    a kind bus driver who waited for me
    a tutor who helped me pass maths
    an editor who improved my first article
    a vet who cared for our old dog at the end
    a colleague who trained me in my first weeks
    my parents for supporting my move abroad
    a neighbour who brought soup when I was ill
    the organisers of a charity walk
    a friend who gave me their old bicycle
    a babysitter who stayed late in an emergency
    a firefighter who gave a talk at my child's school
    a stranger who helped me find my way in a foreign city
    a nurse who stayed calm during a difficult birth
    a boss who allowed me flexible hours
    a speaker whose talk inspired me
    a farmer who let our school visit
    the staff of a hotel that found my lost ring
    a friend who helped me prepare for an interview
    a gardener who gave me cuttings from their garden
    a teenager who helped an elderly neighbour with shopping
    a cousin who let me stay while I looked for a flat
    my swimming teacher who helped me overcome my fear of water
    a client who recommended my business to others
    a fellow volunteer on their last day
    a customer who left a kind review
    a neighbour who rescued our runaway dog
    my old school friend who sent a card when I needed it
    a colleague who stood up for me in a meeting
    a stranger who paid for my coffee
    a chef who made a special meal for my allergies
    a café owner who let me write my novel there for a year
    an uncle who taught me to fish
    my sister who planned our parents' anniversary party
    a grandmother who taught me to bake
    a coworker who helped me learn a new system
    the team at a hospice who cared for my father
    a musician who played at our wedding at short notice
    an author who answered my letter
    the crew of a lifeboat that rescued us
    a professor who encouraged me to keep studying
    a friend who looked after my plants for a summer
    a builder who finished our kitchen on time
    a stranger who helped carry my pushchair up the stairs
    a neighbour who shared vegetables from their garden
    a childminder who looked after my daughter for five years
    a friend who came to every one of my shows
    a shop owner who held an item for me for a week
    the staff of a summer camp my children loved
    a translator who helped at a hospital appointment
    a running club that welcomed me as a beginner
""")

# To whom and for what, after "a sincere apology".
APOLOGIES = _lines("""
    to a friend for missing their birthday dinner without warning
    to a colleague for taking credit for their idea
    to a neighbour for a noisy party that went on too late
    to my sister for forgetting to pick her up from the station
    to a customer for a delayed order
    to my team for losing my temper in a meeting
    to a friend for sharing something they told me in confidence
    to a client for an error in an invoice
    to my parents for not calling for months
    to a teacher for my son's rude behaviour
    to a host for breaking a vase at their party
    to a friend for cancelling our holiday plans at the last minute
    to a neighbour whose car I scratched while parking
    to my partner for forgetting our anniversary
    to a colleague for missing a deadline that affected their work
    to a friend for a joke that hurt them
    to my landlord for paying the rent late
    to a volunteer group for not turning up to an event I promised to help with
    to a teammate for blaming them for a lost game
    to a shop owner for being rude when I was stressed
    to my child for shouting at them
    to my manager for a mistake that upset a client
    to a friend whose book I lost
    to guests for a dinner party that started two hours late
    to a new employee for a chaotic first day
    to the members of a club for a badly organised event
    to my brother for missing his graduation
    to a friend for not supporting them during a hard time
    to my students for marking their work late
    to a neighbour for my dog digging up their garden
    to customers for a website that was down on a busy day
    to a colleague for interrupting them in front of others
    to my flatmate for leaving the kitchen in a mess for weeks
    to a friend for forgetting their wedding anniversary party
    to a business partner for making a decision without them
    to my grandmother for missing her ninetieth birthday
    to a school for my child's damaged library book
    to a guest speaker for a mix-up over their travel
    to passengers for a long delay on a tour I was leading
    to a friend for being late to every meeting this year
    to a supplier for an unpaid invoice
    to a cousin for leaving them off a wedding guest list
    to a colleague for a careless comment about their work
    to a customer whose complaint was ignored
    to a friend for borrowing money and not paying it back on time
    to my coach for skipping training before a big match
    to a neighbour for blocking their driveway
    to my child's friend's parents for a play date that went wrong
    to readers for a mistake in a newsletter
    to a team for a holiday party that excluded some of them
    to a host family for damage to their spare room
    to a friend for not being honest with them
    to a colleague for not inviting them to a meeting
    to my partner for spending our savings without asking
    to a musician for a booking mix-up at a wedding
    to a fellow volunteer for leaving them to do all the work
    to a client for sending a confidential email to the wrong person
    to an old friend for losing touch
    to a child's teacher for a misunderstanding at parents' evening
    to my neighbours for months of building noise
""")

# What happened, after "reporting that".
NEWS = _lines("""
    a ninety-year-old woman has completed her first marathon
    the town's oldest bakery is closing after a century
    a primary school has won a national science prize
    a lost dog found its way home across forty kilometres
    volunteers have restored a derelict railway station
    a rare bird has been spotted in a city park
    the local football team has been promoted for the first time in fifty years
    a teenager has invented a low-cost water filter
    a village has installed its own wind turbine
    the library will open on Sundays from next month
    a community fridge has opened to reduce food waste
    a historic bridge will be closed for a year of repairs
    a new cycle path links two neighbouring towns
    a local café is giving free meals to people living alone at Christmas
    a school has replaced its car park with a garden
    a farmer has found Roman coins in a field
    a town has voted to ban cars from its high street on Saturdays
    a choir of care-home residents has released a song
    a retired teacher has walked the length of the country for charity
    the town's swimming pool has been saved by a community buy-out
    a new market for young traders opens this weekend
    a beaver family has returned to a local river
    a student has designed the town's new flag
    a theatre has reopened after a fire
    a street has been turned into an outdoor classroom
    a repair café has fixed its thousandth item
    the town hall clock has been restored
    a young chess player has become a national champion
    a village shop is now run entirely by volunteers
    a local firm has switched to a four-day week
    a lighthouse has been turned into a museum
    a long-lost painting has been found in an attic
    a heatwave has broken the town's temperature record
    a community orchard has produced its first harvest
    the local hospital has opened a new children's ward
    a town has planted ten thousand trees in a year
    a bus route axed last year has been brought back
    a sheep escaped onto the motorway and stopped traffic
    residents have built a skate park with their own hands
    a pensioner has completed a degree at eighty-five
    a school has stopped giving homework for a year as a trial
    a flood has damaged the high street
    a new ferry service will connect two islands
    a village has held its first carnival in thirty years
    a local author has won a major prize
    a family has run a market stall for five generations
    a wildlife camera has recorded otters in the town centre
    the town has become the first to ban single-use cups
    a mural by local children has been unveiled
    a recycling scheme has cut household waste by a third
    a town has twinned with a village on another continent
    a hospital porter has retired after fifty years
    a charity shop found a valuable first edition among donations
    a new footpath opens along the coast
    a local brass band has been invited to play abroad
    a teenager has rescued a swimmer at the beach
    the town's cinema will show free films for children in the summer
    a dog has been appointed the official mascot of a fire station
    a pop-up museum has opened in an empty shop
    a community energy scheme has cut bills for its members
""")

# Every slot's list, by the name templates give it.
POOLS: dict[str, tuple] = {
    **STYLES,
    "topic": TOPICS,
    "hobby": HOBBIES,
    "hobby_circumstance": HOBBY_CIRCUMSTANCES,
    "practice_time": PRACTICE_TIMES,
    "task": TASKS,
    "trouble": TROUBLES,
    "event": EVENTS,
    "dish": DISHES,
    "diet": DIETS,
    "household": HOUSEHOLDS,
    "goal": GOALS,
    "claim": CLAIMS,
    "choice": CHOICES,
    "situation": SITUATIONS,
    "consultation": CONSULTATIONS,
    "job": JOBS,
    "applicant": APPLICANTS,
    "leaving_reason": LEAVING_REASONS,
    "product": PRODUCTS,
    "product_problem": PRODUCT_PROBLEMS,
    "business": BUSINESSES,
    "customer_issue": CUSTOMER_ISSUES,
    "place": PLACES,
    "season": SEASONS,
    "time_of_day": TIMES_OF_DAY,
    "traveller": TRAVELLERS,
    "restaurant": RESTAURANTS,
    "visit": VISITS,
    "character": CHARACTERS,
    "predicament": PREDICAMENTS,
    "creature": CREATURES,
    "small_adventure": SMALL_ADVENTURES,
    "moral": MORALS,
    "pair": PAIRS,
    "scene_setting": SCENE_SETTINGS,
    "poem_subject": POEM_SUBJECTS,
    "poem_form": POEM_FORMS,
    "song_kind": SONG_KINDS,
    "occasion": OCCASIONS,
    "request": REQUESTS,
    "thanks": THANKS,
    "apology": APOLOGIES,
    "news": NEWS,
}
