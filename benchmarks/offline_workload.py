"""The deterministic offline benchmark workloads, shared by every engine we compare.

`project`: raw prompts (no chat template) of 10-60 words, so prompt lengths vary, and output lengths
spread evenly over [min_out, max_out] then shuffled, so long and short requests are interleaved in the
batch. `mixed`: the same output spread behind prompts of random words whose lengths spread
log-uniformly over 8-700 words (about 10-900 tokens), so prefill and decode shapes both vary widely.
Kept free of torch so any venv (ours, vLLM's) can import it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkItem:
    prompt: str
    max_tokens: int


PROMPTS = [
    "What is the capital of France, and what are a few of the most famous things to see there?",
    "Explain in simple terms why the sky looks blue during the day and red at sunset.",
    "Write a short poem about a cat sleeping in a patch of warm afternoon sunlight.",
    "List three tips for staying focused while working from home.",
    "Describe how a bicycle converts the motion of the rider's legs into forward movement.",
    "What are the main differences between a virus and a bacterium?",
    "Give me a recipe for a quick vegetarian pasta dinner that takes less than thirty minutes.",
    "Summarize the plot of a story in which a young girl finds a hidden door in her grandmother's house "
    "that leads to a garden where it is always spring.",
    "Why do the leaves of many trees change color in autumn before they fall?",
    "Write a polite email to a colleague asking them to review a document by Friday afternoon.",
    "How does a refrigerator keep food cold even when the kitchen around it is warm?",
    "Explain what photosynthesis is to a ten year old child who has never heard the word before.",
    "What should I pack for a three day hiking trip in the mountains in early summer?",
    "Translate the idea of 'better late than never' into a short story with a lesson at the end.",
    "Describe the water cycle, starting from the ocean and ending with rain falling on a city.",
    "What are some good habits for getting a better night's sleep?",
    "Write a short dialogue between a shopkeeper and a customer who is looking for a birthday gift for "
    "their father, who loves gardening and old jazz records.",
    "Explain why exercise is good for both the body and the mind.",
    "How do airplanes stay in the air, and why do their wings have that particular shape?",
    "Compare trains and cars as ways to travel between two cities about three hundred kilometers apart, "
    "considering cost, time, comfort and the effect on the environment.",
    "Write a haiku about the first snow of winter falling on a quiet village at night.",
    "What is the difference between weather and climate? Please give an example of each.",
    "Give five ideas for a fun weekend activity with young children when it is raining outside.",
    "Explain how a public library organizes its books so that readers can find them easily. Cover the "
    "classification system, what the numbers and letters on the spine mean, how the catalog works, how "
    "fiction is usually shelved differently from nonfiction, and what a librarian does when a book "
    "has been put back in the wrong place.",
    "Describe the taste of a ripe mango to someone who has never eaten one.",
    "What are the benefits of learning a second language as an adult, and what makes it harder than "
    "learning one as a child?",
    "Write a motivational message for a friend who is nervous about their first day at a new job.",
    "How do bees make honey, and why do they need to store so much of it?",
    "Explain the basic rules of chess in a few sentences for someone who has never played.",
    "Suggest a name and a short description for a small cafe that serves breakfast all day near a "
    "university campus and wants to attract students.",
    "I often forget to drink water during the day and usually feel tired and get headaches by the "
    "evening. Why is it important to drink enough water every day, how much is enough for an adult "
    "who works at a desk, and what simple tricks could help me remember to drink more regularly?",
    "Write the opening paragraph of a mystery novel set in a quiet fishing village.",
    "What causes the seasons on Earth, and why are they reversed in the southern hemisphere?",
    "Describe a typical day in the life of a lighthouse keeper a hundred years ago, including the chores "
    "they would have done, the dangers they faced and how they spent the long evenings alone.",
    "List the planets of the solar system in order from the sun.",
    "Explain what a budget is and how to make a simple monthly one.",
    "Write a thank you note to a teacher who helped you love reading.",
    "How does recycling paper help the environment, and what happens to it at the plant?",
    "Tell me a short fable about a fox, a crow and a piece of cheese, and explain its moral.",
    "What are the main parts of a plant and what does each part do?",
    "Describe how to make a good cup of tea, step by step.",
    "Why do we have different time zones around the world?",
    "Write a short speech for the opening of a new community garden, thanking the volunteers who built "
    "the raised beds, the neighbors who donated seeds and tools, and the city council for the land.",
    "What is the tallest mountain in the world and where is it?",
    "Give advice to a student who wants to improve their handwriting.",
    "Explain how the moon affects the tides of the ocean.",
    "Write a funny limerick about a forgetful wizard who keeps losing his magic hat.",
    "What qualities make someone a good friend, and how can I be a better friend myself?",
    "Describe the sounds you might hear walking through a busy market early on a Saturday morning, "
    "from the vendors setting up their stalls to the first customers bargaining over fruit.",
    "How do you care for a houseplant that does not get much sunlight?",
    "Explain why the ocean is salty but rivers are not.",
    "Write a product description for a waterproof backpack designed for cyclists.",
    "What are three famous inventions of the nineteenth century and how did they change daily life?",
    "Describe a sunrise over the desert as seen by a traveler camping among the dunes.",
    "Plan a simple weekly exercise routine for a beginner who has about twenty minutes each morning and "
    "no equipment at home, and explain why each exercise was chosen.",
    "Why do cats purr, and does purring always mean that a cat is happy?",
    "Write a short letter from an astronaut on the space station to their family back on Earth.",
    "How does a magnetic compass work, and why does its needle always point north?",
    "Explain the difference between a lake, a pond and a reservoir.",
    "Tell a bedtime story about a little dragon who is afraid of the dark and the firefly who helps him "
    "find his way home through the forest.",
    "What are some ways to reduce food waste at home?",
    "Describe how bread dough rises before and while it is baked in the oven.",
    "Give a brief history of the printing press and explain why it mattered so much for the spread of "
    "ideas in Europe.",
    "What is the best way to learn to play a musical instrument?",
]


WORKLOADS = ("project", "mixed")


def make_workload(num_prompts: int = 64, min_out: int = 8, max_out: int = 256, seed: int = 0,
                  kind: str = "project") -> list[WorkItem]:
    """Return num_prompts requests; the same arguments always give the same list."""
    if num_prompts < 1 or not 1 <= min_out <= max_out:
        raise ValueError(f"need num_prompts >= 1 and 1 <= min_out <= max_out, got {num_prompts}, {min_out}, {max_out}")
    if kind not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {kind!r}")
    lengths = _output_lengths(num_prompts, min_out, max_out, seed)
    if kind == "mixed":
        return [WorkItem(p, n) for p, n in zip(_random_word_prompts(num_prompts, seed), lengths, strict=True)]
    # More requests than prompts reuse prompts in order; prompt i always pairs with the same slot.
    return [WorkItem(PROMPTS[i % len(PROMPTS)], n) for i, n in enumerate(lengths)]


def _output_lengths(num_prompts: int, min_out: int, max_out: int, seed: int) -> list[int]:
    # Evenly spread (linspace, rounded) so the total work does not depend on the seed.
    if num_prompts == 1:
        lengths = [max_out]
    else:
        step = (max_out - min_out) / (num_prompts - 1)
        lengths = [round(min_out + i * step) for i in range(num_prompts)]
    random.Random(seed).shuffle(lengths)
    return lengths


def _random_word_prompts(num_prompts: int, seed: int, min_words: int = 8, max_words: int = 700) -> list[str]:
    """Prompts of words drawn from PROMPTS' vocabulary, lengths log-uniform over [min_words, max_words]."""
    rng = random.Random(seed + 1)
    vocabulary = sorted({w.strip(".,?!'") for p in PROMPTS for w in p.split()} - {""})
    ratio = max_words / min_words
    return [" ".join(rng.choices(vocabulary, k=round(min_words * ratio ** rng.random())))
            for _ in range(num_prompts)]
