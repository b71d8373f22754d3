"""Prompts written here from templates x hand-made topic lists, one pool category per family: writing,
roleplay, reasoning, stem, humanities, qa, coding, extraction, translation (sentences below).

It knows nothing about the target, the tokenizer or other sources: each function returns
``(category, user message)`` pairs, distinct, seeded. No template copies a benchmark prompt; the
categories only mirror the kinds of chat tasks that MT-bench-style evaluations ask about.
"""

from __future__ import annotations

import itertools
import random

GENERAL = [
    "photosynthesis", "the French Revolution", "black holes", "climate change", "the stock market",
    "machine learning", "the human immune system", "volcanoes", "the Roman Empire", "renewable energy",
    "the water cycle", "social media", "electric cars", "the Renaissance", "vaccines", "coffee",
    "the internet", "honey bees", "the Great Wall of China", "plate tectonics", "inflation",
    "meditation", "the Olympic Games", "quantum computers", "jazz music", "recycling", "the moon landing",
    "sleep", "chess", "the printing press", "rainforests", "cryptocurrency", "the Industrial Revolution",
    "DNA", "earthquakes", "public libraries", "remote work", "the Silk Road", "gravity", "ocean tides",
    "democracy", "antibiotics", "video games", "the Amazon river", "solar panels", "friendship",
    "time management", "ancient Egypt", "artificial sweeteners", "urban gardening", "the periodic table",
    "supply and demand", "Shakespeare", "dinosaurs", "nuclear energy", "minimalism", "the Cold War",
    "bicycles", "mountain climbing", "online privacy", "the human brain", "tea ceremonies", "robots",
    "space tourism", "fast fashion", "the metric system", "wolves", "bread baking", "hurricanes",
    "public transport", "volunteering", "street food", "coral reefs", "podcasts", "board games",
    "learning a second language", "small businesses", "museums", "marathon running", "home cooking",
    "city parks", "family traditions", "online shopping", "wildfires", "desert ecosystems", "kites",
    "lighthouses", "trains", "newspapers", "handwriting", "birdwatching", "the night sky", "tattoos",
]
STEM = [
    "Newton's laws of motion", "entropy", "the speed of light", "cell division", "photosynthesis",
    "the Pythagorean theorem", "prime numbers", "the theory of evolution", "chemical bonds", "acids and bases",
    "electric circuits", "magnetism", "the greenhouse effect", "plate tectonics", "the structure of the atom",
    "nuclear fission", "nuclear fusion", "the immune response", "enzymes", "the nervous system",
    "probability", "derivatives in calculus", "integrals", "linear equations", "matrices", "vectors",
    "binary numbers", "sorting algorithms", "hash tables", "recursion", "neural networks", "compilers",
    "operating systems", "TCP/IP", "public-key cryptography", "the Doppler effect", "sound waves",
    "the electromagnetic spectrum", "semiconductors", "lasers", "black holes", "the Big Bang",
    "exoplanets", "the Moon's phases", "tides", "the carbon cycle", "the nitrogen cycle", "genetics",
    "CRISPR", "viruses and bacteria", "vaccination", "blood circulation", "the kidneys", "metabolism",
    "statistics and sampling", "the normal distribution", "logarithms", "complex numbers", "graph theory",
    "the Fibonacci sequence", "fractals", "friction", "buoyancy", "pressure", "heat transfer",
    "states of matter", "catalysts", "polymers", "batteries", "solar cells", "wind turbines",
    "climate models", "ocean currents", "weather fronts", "earthquakes", "volcanic eruptions",
    "the periodic table", "isotopes", "radioactive decay", "relativity", "quantum entanglement",
    "superconductivity", "machine learning", "gradient descent", "databases", "encryption",
]
HUMANITIES = [
    "the French Revolution", "the Renaissance", "the Roman Republic", "ancient Greek philosophy",
    "Confucianism", "Buddhism", "the Enlightenment", "the Industrial Revolution", "colonialism",
    "the printing press", "the Silk Road", "the Cold War", "the civil rights movement", "impressionism",
    "the Baroque period", "Shakespeare's tragedies", "the epic of Gilgamesh", "Greek mythology",
    "Norse mythology", "the Ottoman Empire", "the Mongol Empire", "the Maya civilization", "the Inca Empire",
    "feudalism", "the Reformation", "the Magna Carta", "the social contract", "utilitarianism",
    "existentialism", "stoicism", "the scientific revolution", "modern architecture", "jazz",
    "classical music", "the history of cinema", "the novel as a form", "poetry and rhyme",
    "the role of museums", "language change", "the origins of writing", "human rights",
    "democracy in ancient Athens", "the fall of the Berlin Wall", "the history of money", "globalization",
    "urbanization", "the role of religion in society", "ethics of artificial intelligence",
    "freedom of speech", "the welfare state", "economic inequality", "nationalism", "the Olympic ideal",
    "the history of medicine", "folk tales", "oral traditions", "the Harlem Renaissance", "romanticism",
    "modernism in literature", "cubism", "surrealism", "the Bauhaus", "opera", "theatre in ancient Greece",
    "the Meiji Restoration", "the partition of India", "the American Revolution", "the Haitian Revolution",
    "the history of universities", "the philosophy of mind", "free will", "the trolley problem",
    "the concept of justice", "cultural heritage", "translation and meaning", "propaganda",
]
PEOPLE = [
    "a pirate captain", "a medieval knight", "a detective", "a friendly robot", "a chef", "a pilot",
    "a marine biologist", "a famous painter", "an astronaut", "a high school coach", "a librarian",
    "a travel guide in Rome", "a wizard", "a startup founder", "a park ranger", "a history teacher",
    "a grumpy cat", "a time traveller from the year 3000", "a lighthouse keeper", "a jazz musician",
    "a nurse on a night shift", "a museum curator", "a mountain guide", "a barista", "a taxi driver",
    "a news reporter", "a farmer", "a fashion designer", "a video game character", "a dragon",
    "a personal fitness trainer", "a career counsellor", "a stand-up comedian", "an ancient Roman senator",
    "a sommelier", "a kindergarten teacher", "a football commentator", "a beekeeper", "a tour guide in Kyoto",
    "a sailor", "a poet", "a village elder", "a space station engineer", "a veterinarian", "a film critic",
]
LANGS = ["Python", "JavaScript", "C++", "Java", "Rust", "Go", "SQL", "Bash", "TypeScript", "C"]
CODE_TASKS = [
    "reverses a linked list", "checks whether a string is a palindrome", "merges two sorted lists",
    "counts the words in a text file", "computes the factorial of a number", "finds the largest element in an array",
    "removes duplicates from a list", "implements binary search", "validates an email address",
    "converts Celsius to Fahrenheit", "computes the greatest common divisor of two numbers",
    "sorts a list of dictionaries by a key", "reads a CSV file and prints the average of a column",
    "checks whether a number is prime", "implements a stack with push and pop", "flattens a nested list",
    "returns the n-th Fibonacci number iteratively", "counts vowels in a string", "rotates a matrix by 90 degrees",
    "finds the longest common prefix of a list of strings", "parses a date string", "implements a queue with two stacks",
    "computes the median of a list", "checks whether two strings are anagrams", "finds all pairs that sum to a target",
    "implements an LRU cache", "converts a Roman numeral to an integer", "computes the edit distance of two strings",
    "finds the shortest path in a grid with BFS", "transposes a matrix", "groups words by their first letter",
    "counts the frequency of each character", "checks balanced parentheses", "implements merge sort",
    "implements quicksort", "computes a running average", "splits a list into chunks of size n",
    "finds the second largest number", "capitalises the first letter of every word", "computes the power set",
]
WRITING = [
    "Write a short blog post about {t}.", "Write a poem about {t}.", "Write a haiku about {t}.",
    "Compose a short story in which {t} plays an important role.", "Write a persuasive essay introduction "
    "arguing that everyone should learn about {t}.", "Write a product description for a board game about {t}.",
    "Draft an email inviting colleagues to a talk on {t}.", "Write a dialogue between two friends discussing {t}.",
    "Write a tweet thread (five tweets) about {t}.", "Write a limerick about {t}.",
    "Write the opening paragraph of a mystery novel that involves {t}.", "Write a speech for a school "
    "assembly about {t}.", "Write a letter to the editor of a local newspaper about {t}.",
    "Write a short travel diary entry that mentions {t}.", "Write a motivational message inspired by {t}.",
    "Write song lyrics about {t}.", "Write a children's bedtime story about {t}.", "Write a news headline "
    "and a short article about a discovery related to {t}.", "Write a review of an imaginary documentary about {t}.",
    "Write a cover letter for a job at a company that works on {t}.", "Write an advertisement for a "
    "workshop on {t}.", "Rewrite the idea of {t} as a fairy tale.", "Write a short script for a video "
    "explaining {t}.", "Write a diary entry of someone who is learning about {t} for the first time.",
]
ROLEPLAY = [
    "Pretend you are {p}. Describe your typical day.", "You are {p}. Give advice to a newcomer in your field.",
    "Act as {p} and explain {t} in your own words.", "Imagine you are {p}. Write a letter to your younger self.",
    "You are {p}. A customer asks you about {t}. What do you say?", "Play the role of {p} and introduce "
    "yourself to a class of students.", "Stay in character as {p} and tell me about your biggest challenge.",
    "You are {p}. Convince me to try something new.", "Act as {p} who has just heard about {t}. React to the news.",
    "Imagine you are {p} being interviewed on the radio. Answer the question: what do you love about your work?",
    "As {p}, describe the most memorable thing that happened to you last week.",
    "Role-play as {p} and give me three tips about {t}.",
]
STEM_T = [
    "Explain {t} to a ten-year-old.", "Explain {t} to a university student.", "What is {t}, and why does it "
    "matter?", "What are common misconceptions about {t}?", "Give a real-world example of {t} and explain it.",
    "How would you teach {t} in a one-hour class? Give a lesson plan.", "List the key terms someone should "
    "know about {t}, with a one-line definition each.", "Create a quiz with three questions about {t}, with answers.",
    "Describe an experiment that demonstrates {t}.", "How is {t} related to {u}?", "Summarize what scientists "
    "know about {t} in one paragraph.", "What are open research questions about {t}?",
    "Write a short explanation of {t} with an analogy.", "What mathematics is needed to understand {t}?",
]
HUM_T = [
    "Summarize the history of {t} in a paragraph.", "What were the main causes and effects of {t}?",
    "Discuss the legacy of {t} today.", "Compare {t} and {u}. How are they similar and different?",
    "What ethical questions does {t} raise?", "Write a short essay on {t}.", "Who were the key figures "
    "associated with {t}, and what did they contribute?", "How did {t} influence art and culture?",
    "Give three arguments for and three against the importance of {t}.", "Explain {t} to someone who has "
    "never heard of it.", "What can we learn from {t}?", "Describe {t} from the point of view of an ordinary person "
    "living at the time.", "What are the main schools of thought about {t}?",
]
QA_T = [
    "What is {t}?", "Why is {t} important?", "How does {t} work?", "What are the pros and cons of {t}?",
    "Give me five interesting facts about {t}.", "Describe how {t} affects everyday life.",
    "What should a beginner know about {t}?", "What is the history of {t} in brief?", "How can I learn more about {t}?",
    "What are the most common questions people ask about {t}? Answer two of them.", "Is {t} good or bad? Explain.",
    "How might {t} change in the next twenty years?",
]
CODE_T = [
    "Write a {l} function that {c}.", "Explain step by step how to write a {l} program that {c}.",
    "Write a {l} function that {c}, and add a short test.", "What is the time complexity of a {l} function that "
    "{c}? Write one and explain.", "Write a {l} function that {c}. Comment each line.",
    "I need a {l} snippet that {c}. Keep it short.", "Write a {l} class whose main method {c}.",
]
REASON_T = [
    "If a train leaves at {h} pm and travels {a} km at {b} km/h, when does it arrive? Explain.",
    "A shop sells pens at ${a} each and notebooks at ${b} each. How much do 3 pens and 2 notebooks cost?",
    "I have {a} apples and give away {b}. Then I buy twice as many as I have left. How many do I have?",
    "What is {a} multiplied by {b}? Show your work.", "Is {a} a prime number? Explain your reasoning.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "Solve for x: {a}x + {b} = {c}. Show each step.", "What is {a}% of {c}? Explain.",
    "A car uses {b} litres of fuel per 100 km. How much fuel does it need for {c} km?",
    "Tom is {a} years old and his sister is {b} years younger. How old will she be in {h} years?",
    "There are {a} students in a class and {b} of them are absent. What fraction is present? Simplify it.",
    "If {a} workers build a wall in {b} days, how long would {c} workers take at the same rate?",
    "Find the next two numbers in the sequence {a}, {ab}, {aab}, ... and explain the pattern.",
    "A bag has {a} red and {b} blue marbles. What is the probability of drawing a red one?",
]
LOGIC = [
    "Alice is taller than Bob, and Bob is taller than Carol. Who is the shortest? Explain.",
    "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain.",
    "A farmer has to cross a river with a wolf, a goat and a cabbage. How can he do it?",
    "You have two ropes that each burn in exactly one hour, unevenly. How can you measure 45 minutes?",
    "Three boxes are labelled apples, oranges and mixed, and every label is wrong. How many fruits must "
    "you pick to label them correctly?",
    "If it is raining, the ground is wet. The ground is wet. Is it necessarily raining? Explain.",
    "A bat and a ball cost $1.10 in total. The bat costs $1.00 more than the ball. How much is the ball?",
    "What comes next: Monday, Wednesday, Friday, ...? Explain the rule.",
    "Five people shake hands with each other once. How many handshakes are there?",
    "A clock shows 3:15. What is the angle between the hour and the minute hands?",
]
SENTENCES = [
    "On March 3rd, Maria Lopez opened a small bakery in Lisbon, and by June it had a queue every morning.",
    "The hotel was clean, but the staff ignored our requests and the breakfast was cold every day.",
    "In 1998, Tom and his sister Anna sailed from Dublin to Reykjavik in a boat they had built themselves.",
    "I loved this phone: the battery lasts two days and the camera takes great photos at night.",
    "The city council of Springfield voted on Tuesday to close the old bridge until repairs are finished.",
    "After three years of research in Kenya, Dr. Amina Yusuf published a study on elephant migration.",
    "The package arrived two weeks late and the box was damaged, although the lamp inside worked fine.",
    "Our team meeting moved from Monday 10 am to Wednesday 2 pm in room 4B; please bring your reports.",
    "Chen Wei, a 34-year-old engineer from Shanghai, won the Berlin marathon on September 24 in 2:11:05.",
    "The restaurant's pasta was excellent, the service was friendly, and the prices were reasonable.",
    "Last summer the museum in Oslo displayed 120 paintings by Edvard Munch, attracting 300,000 visitors.",
    "The new library opens at 9 am on weekdays and 11 am on Sundays, and it is closed on public holidays.",
    "Please send the signed contract to Julia Novak at the Prague office before Friday, 5 November.",
    "The film was far too long and the plot made no sense, but the music was beautiful.",
    "In April, the company Greenleaf hired 45 new employees in Toronto and opened a second factory.",
    "My flight from Madrid to Tokyo was delayed by six hours, and the airline offered a meal voucher.",
    "The weather tomorrow will be sunny in the morning, with rain expected in the evening in Manchester.",
    "Professor Ahmed Karim will give a lecture on ancient trade routes at Cairo University on 12 May.",
    "I bought these headphones for my son; the sound is good but they broke after a month.",
    "The children planted twenty apple trees in the school garden during the spring festival.",
]
EXTRACT_T = [
    "Extract all the names, dates and places from this text: {s}", "Classify the sentiment of this review as "
    "positive, negative or neutral, and explain why: {s}", "Turn the following into a JSON object with the fields "
    "who, what, when, where: {s}", "Give three keywords for the following text: {s}",
    "List every number that appears in this text and what it refers to: {s}",
    "Rewrite this sentence in a formal tone: {s}", "Write a question whose answer is in this text, then answer it: {s}",
    "Identify the main event in this text in five words or fewer: {s}",
]
TRANS_LANGS = ["French", "Spanish", "German", "Italian", "Portuguese", "Chinese", "Japanese", "Russian", "Dutch", "Arabic"]
TRANS_T = [
    "Translate the following sentence into {lang}: {s}", "Translate into {lang}:\n\n{s}",
    "How would you say this in {lang}? \"{s}\"", "Please translate this text to {lang} and keep the meaning: {s}",
]


def _take(rng: random.Random, combos: list[str], n: int) -> list[str]:
    combos = sorted(set(combos))
    rng.shuffle(combos)
    return combos[:n]


def template_prompts(counts: dict[str, int], seed: int = 0) -> list[tuple[str, str]]:
    """``counts[category]`` distinct prompts for each of writing, roleplay, stem, humanities, qa, coding,
    reasoning, extraction, translation (fewer when the templates run out)."""
    rng = random.Random(seed)
    pairs = lambda xs: [(a, b) for a, b in itertools.permutations(xs, 2)]  # noqa: E731
    fam: dict[str, list[str]] = {
        "writing": [t.format(t=x) for t in WRITING for x in GENERAL],
        "roleplay": [t.format(p=p, t=x) for t in ROLEPLAY for p in PEOPLE for x in (GENERAL if "{t}" in t else [""])],
        "stem": [t.format(t=a, u=b) for t in STEM_T for a, b in (pairs(STEM) if "{u}" in t else [(x, "") for x in STEM])],
        "humanities": [t.format(t=a, u=b) for t in HUM_T
                       for a, b in (pairs(HUMANITIES) if "{u}" in t else [(x, "") for x in HUMANITIES])],
        "qa": [t.format(t=x) for t in QA_T for x in GENERAL + STEM[:40] + HUMANITIES[:40]],
        "coding": [t.format(l=lang, c=c) for t in CODE_T for lang in LANGS for c in CODE_TASKS],
        "extraction": [t.format(s=s) for t in EXTRACT_T for s in SENTENCES],
        "translation": [t.format(lang=lang, s=s) for t in TRANS_T for lang in TRANS_LANGS for s in SENTENCES],
    }
    reason = set(LOGIC)
    while len(reason) < 20 * len(REASON_T):
        a, b, c, h = rng.randint(2, 97), rng.randint(2, 60), rng.randint(100, 999), rng.randint(1, 11)
        reason.add(rng.choice(REASON_T).format(a=a, b=b, c=c, h=h, ab=a * 2, aab=a * 4))
    fam["reasoning"] = list(reason)
    out = []
    for cat, n in counts.items():
        out += [(cat, s) for s in _take(rng, fam[cat], n)]
    return out
