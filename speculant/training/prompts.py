"""Requests for the target to answer, shaped like what users ask an assistant: code in several
languages, everyday questions and advice, short pieces of writing, and rewrites of those pieces.

A head learns the target's habits on the kind of text it sees; one trained on answers to requests
built from the standard library's docstrings and package descriptions agreed with the target far
less on the bench's requests than on held-out data of its own kind. These lists widen what the
requests look like (docs/training.md). The bench's own prompts (speculant/data/prompts) are left out of every list
so the bench measures held-out text.
"""

from __future__ import annotations

import random
import re

LANGUAGES = ("Python", "Python", "Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "C#",
             "Ruby", "PHP", "Kotlin", "Swift")
CODE_TASKS = (
    "reverses the words in a sentence", "counts the vowels in a string", "returns the n-th prime number",
    "checks whether a year is a leap year", "converts Celsius to Fahrenheit", "flattens a nested list",
    "removes duplicates from a list while keeping the order", "finds the largest number in a list",
    "computes the factorial of a number", "returns the greatest common divisor of two numbers",
    "checks whether two strings are anagrams", "counts how often each word appears in a text",
    "validates an email address with a regular expression", "converts a Roman numeral to an integer",
    "converts an integer to binary", "sorts a list of dictionaries by a key", "finds the median of a list",
    "splits a list into chunks of size n", "capitalizes the first letter of every word",
    "computes the sum of the digits of a number", "checks whether a number is a power of two",
    "returns the longest common prefix of a list of strings", "rotates a list by k positions",
    "transposes a matrix", "multiplies two matrices", "performs a binary search on a sorted list",
    "implements bubble sort", "implements quicksort", "implements insertion sort",
    "generates all permutations of a list", "generates all subsets of a set",
    "parses a date string in the format YYYY-MM-DD", "returns the number of days between two dates",
    "reads a text file and returns its number of lines", "writes a list of rows to a CSV file",
    "reads a JSON file and prints its keys", "downloads a web page and returns its title",
    "converts a string to snake_case", "converts a string to camelCase",
    "truncates a string to n characters with an ellipsis", "checks whether parentheses in a string are balanced",
    "computes a running average of a list", "finds the second largest number in a list",
    "groups a list of words by their first letter", "returns the intersection of two lists",
    "merges two dictionaries", "counts the bits set in an integer", "generates a random password of a given length",
    "computes compound interest", "converts kilometres to miles", "computes the area of a circle",
    "checks whether a string is a valid IPv4 address", "shuffles a list in place", "implements a simple LRU cache",
    "implements a queue with two stacks", "reverses a linked list", "detects a cycle in a linked list",
    "computes the depth of a binary tree", "performs a breadth-first search on a graph",
    "finds the shortest path in a grid", "counts the islands in a grid of 0s and 1s",
    "computes the edit distance of two strings", "returns the most common element of a list",
    "encodes a string with run-length encoding", "decodes a run-length encoded string",
    "implements the Caesar cipher", "formats a number with thousands separators",
    "converts seconds to hours, minutes and seconds", "checks whether a sentence is a pangram",
    "retries a function call up to three times", "measures how long a function takes to run",
    "computes the moving maximum of a list with a window of size k",
    "finds all pairs in a list that sum to a target",
)
CLASS_TASKS = (
    ("BankAccount", "deposit, withdraw and balance methods, refusing to withdraw more than the balance"),
    ("Rectangle", "width and height, and methods for its area and perimeter"),
    ("TodoList", "methods to add, complete and list tasks"),
    ("Temperature", "a value in Celsius and properties for Fahrenheit and Kelvin"),
    ("Inventory", "methods to add items, remove items and report what is low in stock"),
    ("Counter", "increment, decrement and reset methods"),
    ("Matrix", "addition and multiplication of two matrices"),
    ("Library", "methods to add books, lend a book and return a book"),
    ("Timer", "start, stop and elapsed methods"),
    ("ShoppingCart", "methods to add items with prices and compute the total with a discount"),
    ("Queue", "enqueue, dequeue and size methods"),
    ("Student", "a name, a list of grades and a method for the average grade"),
)
SQL_TASKS = (
    "returns the number of orders per month in 2022, from a table orders(id, customer_id, amount, created_at)",
    "finds the employees who earn more than their manager, from a table employees(id, name, salary, manager_id)",
    "lists the products that were never ordered, from tables products(id, name) and order_items(order_id, product_id)",
    "returns the average salary per department, from tables employees(id, name, salary, department_id) and "
    "departments(id, name)",
    "deletes duplicate rows from a table emails(id, address), keeping the lowest id",
    "returns the ten most recent posts with their author's name, from tables posts(id, user_id, title, created_at) "
    "and users(id, name)",
    "counts the users who signed up each day last week, from a table users(id, email, created_at)",
    "returns the second highest salary from a table employees(id, name, salary)",
)
SHELL_TASKS = (
    "renames every .jpeg file in the current folder to .jpg", "backs up a folder into a dated tar.gz archive",
    "prints the five largest files under a folder", "checks whether a website answers and prints its status code",
    "deletes log files older than seven days", "counts the words in every .txt file in a folder",
    "prints the disk usage of each subfolder, sorted", "finds every file that contains the word TODO",
)
CODE_TEMPLATES = (
    "Write a {lang} function that {task}.",
    "Write a {lang} function that {task}, with a short example of how to call it.",
    "How do I write a function in {lang} that {task}?",
    "Write a {lang} function that {task}. Add comments that explain each step.",
    "Can you show me {lang} code that {task}?",
)


TOPICS = (
    "learning a new language", "saving money", "growing tomatoes", "running a marathon", "baking bread",
    "writing a resume", "public speaking", "keeping a journal", "training a puppy", "painting with watercolors",
    "starting a small business", "planning a wedding", "cleaning a kitchen", "learning to swim",
    "volcanoes", "the water cycle", "black holes", "the French Revolution", "electric cars", "solar panels",
    "recycling plastic", "the human heart", "honey bees", "earthquakes", "the moon's phases", "rainbows",
    "compound interest", "climate change", "the printing press", "coffee", "chess", "yoga",
    "meditation", "time management", "remote work", "job interviews", "first aid", "camping in the desert",
    "moving to a new city", "choosing a laptop", "password security", "backing up photos", "email etiquette",
    "the Roman Empire", "ancient Egypt", "the Olympic Games", "jazz music", "photography", "birdwatching",
    "composting", "houseplants", "cooking rice", "making pasta", "healthy breakfasts", "drinking water",
    "stretching", "cycling to work", "learning to code", "databases", "the internet", "machine learning",
    "spreadsheets", "3D printing", "the stock market", "renting an apartment", "buying a used car",
    "negotiating a salary", "writing a cover letter", "studying for exams", "reading more books",
    "teaching children to read", "board games", "tea", "chocolate", "sharks", "elephants", "dolphins",
    "penguins", "rainforests", "deserts", "glaciers", "tides", "gravity", "magnets", "electricity",
    "the speed of light", "DNA", "the immune system", "antibiotics", "nutrition labels", "fermentation",
    "bicycles", "airplanes", "trains", "bridges", "skyscrapers", "lighthouses", "maps", "calendars",
    "knitting", "gardening on a balcony", "budgeting for a holiday", "making friends as an adult",
    "dealing with stress", "waking up early", "cooking for one", "hosting a dinner party", "the Great Wall of China",
    "the Amazon river", "octopuses", "wolves", "owls", "the solar system", "Mars", "comets", "clouds",
    "thunderstorms", "hurricanes", "the seasons", "coral reefs", "bees and flowers", "bread yeast",
    "the history of money", "the first computers", "smartphones", "social media", "online privacy",
    "video games", "learning the piano", "drawing portraits", "writing poetry", "keeping a budget",
    "paying off debt", "buying a house", "working from a café", "traveling by train in Europe",
    "packing light", "jet lag", "learning to drive", "car maintenance", "riding a motorcycle",
    "recycling electronics", "reducing food waste", "water-saving at home", "insulating a house",
)
QUESTION_TEMPLATES = (
    "Tell me about {topic}.",
    "What are the main benefits of {topic}?",
    "How do I get started with {topic}?",
    "Give me three tips about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "What are common mistakes people make with {topic}?",
    "Write a short list of facts about {topic}.",
    "What should a beginner know about {topic}?",
    "Can you explain {topic} in simple words?",
    "What are five interesting facts about {topic}?",
    "Give me a short plan for {topic}.",
    "What are the pros and cons of {topic}?",
    "Why is {topic} important?",
    "Summarize the history of {topic} in a few sentences.",
    "I want to learn about {topic}. Where should I start?",
)
PAIRS = (
    ("weather", "climate"), ("a crocodile", "an alligator"), ("a latte", "a cappuccino"), ("RAM", "storage"),
    ("a star", "a planet"), ("baking soda", "baking powder"), ("a lake", "a pond"), ("a hurricane", "a tornado"),
    ("Python", "JavaScript"), ("a list", "a tuple in Python"), ("speed", "velocity"), ("a frog", "a toad"),
    ("an emu", "an ostrich"), ("a debit card", "a credit card"), ("renting", "buying a home"),
    ("a psychologist", "a psychiatrist"), ("HTTP", "HTTPS"), ("a simile", "a metaphor"), ("mass", "weight"),
)
INGREDIENTS = ("rice", "beans", "an onion", "potatoes", "chicken", "spinach", "carrots", "pasta", "garlic",
               "mushrooms", "lentils", "a can of tuna", "bread", "yogurt", "peppers", "tofu", "apples", "oats")
SOCIAL_TASKS = (
    "ask my neighbour to turn the music down", "tell a friend I can't come to their party",
    "ask my boss for a day off", "remind a colleague about a deadline", "say no to extra work",
    "ask for a refund in a shop", "apologize for being late to a meeting", "thank a teacher at the end of the year",
    "ask my landlord to fix the heating", "end a phone call that goes on too long",
)
ADVICE_TEMPLATES = (
    "I have {ingredients}. What can I cook?",
    "How do I politely {social}?",
    "What is the difference between {a} and {b}?",
    "Give me a short plan to {goal} in {time}.",
)
GOALS = ("learn basic Spanish", "run five kilometres", "read ten books", "learn to cook", "save for a bicycle",
         "get better at drawing", "learn touch typing", "improve my posture", "learn to juggle", "sleep earlier")
TIMES = ("two weeks", "one month", "six weeks", "three months", "a year")


NAMES = ("Maria", "Leo", "Amira", "Kenji", "Sofia", "David", "Lena", "Omar", "Julia", "Noah", "Priya", "Lucas")
WRITING_TEMPLATES = (
    "Write a short paragraph about {topic}.",
    "Write a short story about {name}, who is {activity}.",
    "Write a short email to a colleague about {topic}.",
    "Write a casual message to a friend about {activity}.",
    "Describe a typical day of {name}, who works as a {job}.",
    "Write a short paragraph describing {place}.",
)
ACTIVITIES = ("learning to bake bread", "moving to a new city", "training for a race", "starting a garden",
              "looking for a lost cat", "preparing for a job interview", "visiting a museum", "fixing an old bike",
              "planning a surprise party", "taking a train across the country", "learning to paint")
JOBS = ("nurse", "baker", "teacher", "bus driver", "librarian", "farmer", "software developer", "chef",
        "firefighter", "postman", "hotel receptionist", "gardener")
PLACES = ("a busy train station in the morning", "a small fishing village", "a quiet library", "a market on a "
          "Sunday", "a mountain hut in winter", "a city park in spring", "a school playground", "an old bookshop")

REWRITE_INSTRUCTIONS = (
    "Rewrite this paragraph in simpler words:",
    "Rewrite the following paragraph in a formal tone:",
    "Rewrite the following paragraph in a casual, friendly tone:",
    "Rewrite the following paragraph in the past tense:",
    "Rewrite the following paragraph in the present tense:",
    "Rewrite this paragraph as a bulleted list of its facts:",
    "Rewrite the following paragraph in plain English for a child:",
    "Rewrite the following paragraph to make it shorter, keeping its meaning:",
    "Summarize this paragraph in two sentences:",
    "Rewrite the following paragraph in the first person:",
)
FIX_INSTRUCTIONS = (
    "Fix the typos in this paragraph and return the corrected paragraph:",
    "Rewrite the following paragraph with correct grammar and spelling, keeping its meaning:",
    "Correct the spelling mistakes in this text:",
    "Proofread this paragraph and return the corrected version:",
)
PUNCTUATION_INSTRUCTION = "Rewrite the following paragraph with correct punctuation and capital letters:"


def code_request(rng: random.Random) -> str:
    """A request for code: a function in one of several languages, a class, a query or a script."""
    roll = rng.random()
    if roll < 0.12:
        name, what = rng.choice(CLASS_TASKS)
        return f"Write a {rng.choice(('Python', 'Python', 'Java', 'TypeScript'))} class `{name}` with {what}."
    if roll < 0.2:
        return f"Write a SQL query that {rng.choice(SQL_TASKS)}."
    if roll < 0.28:
        return f"Write a bash script that {rng.choice(SHELL_TASKS)}."
    return rng.choice(CODE_TEMPLATES).format(lang=rng.choice(LANGUAGES), task=rng.choice(CODE_TASKS))


def everyday_question(rng: random.Random) -> str:
    """A question or request for advice, as people ask an assistant."""
    if rng.random() < 0.7:
        return rng.choice(QUESTION_TEMPLATES).format(topic=rng.choice(TOPICS))
    template = rng.choice(ADVICE_TEMPLATES)
    a, b = rng.choice(PAIRS)
    return template.format(ingredients=_join(rng.sample(INGREDIENTS, rng.randint(2, 4))),
                           social=rng.choice(SOCIAL_TASKS), a=a, b=b, goal=rng.choice(GOALS), time=rng.choice(TIMES))


def writing_request(rng: random.Random) -> str:
    """A request for a short piece of everyday writing (its answer is later material to rewrite)."""
    activity = rng.choice(ACTIVITIES)  # drawn first: the order of draws is part of what a seed makes
    return rng.choice(WRITING_TEMPLATES).format(topic=rng.choice(TOPICS), name=rng.choice(NAMES), activity=activity,
                                                job=rng.choice(JOBS), place=rng.choice(PLACES))


def rewrite_request(paragraph: str, rng: random.Random) -> str:
    """A rewrite request on `paragraph`: a third ask to fix typos put in on purpose, some to restore
    punctuation taken out, the rest to change tone, tense, length or form."""
    roll = rng.random()
    if roll < 1 / 3:
        return rng.choice(FIX_INSTRUCTIONS) + "\n\n" + add_typos(paragraph, rng)
    if roll < 0.45:
        return PUNCTUATION_INSTRUCTION + "\n\n" + strip_punctuation(paragraph)
    return rng.choice(REWRITE_INSTRUCTIONS) + "\n\n" + paragraph


def add_typos(text: str, rng: random.Random, rate: float = 0.08) -> str:
    """Swap, drop or double a letter in about `rate` of the words; lowercase some sentence starts."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 3 and w.isalpha() and rng.random() < rate:
            j = rng.randrange(1, len(w) - 1)
            words[i] = rng.choice((w[:j] + w[j + 1] + w[j] + w[j + 2:], w[:j] + w[j + 1:], w[:j] + w[j] + w[j:]))
        elif i and words[i - 1].endswith(".") and rng.random() < 0.5:
            words[i] = w.lower()
    return " ".join(words)


def strip_punctuation(text: str) -> str:
    """Lowercase, without commas and full stops: what a hurried message looks like."""
    return re.sub(r"[.,;!?]", "", text).lower()


def answer_paragraph(answer: str, min_chars: int = 150, max_chars: int = 900) -> str | None:
    """The longest prose paragraph of an answer, if one is long enough to be worth rewriting."""
    paras = [p.strip() for p in answer.split("\n\n")
             if p.strip() and not p.lstrip().startswith(("-", "*", "#", "```", "1."))]
    best = max(paras, key=len, default="")
    if len(best) > max_chars:  # whole sentences, as a user would paste them
        best = best[:best.rfind(". ", 0, max_chars) + 1]
    return best if len(best) >= min_chars else None


def _join(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1]
