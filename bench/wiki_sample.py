"""Extract the English Wikipedia sample of DATA.md to a text file (the prose text of bench/awq.py).

Needs gensim (only here, not an edgerun dependency), e.g. in a throwaway venv:
    python -m venv /tmp/gs && /tmp/gs/bin/pip install numpy scipy smart_open gensim==4.4.0
    /tmp/gs/bin/python bench/wiki_sample.py /tmp/enwiki_sample.txt
Redirects and pages under 500 characters are dropped: 105 articles, about 3.1 MB.
"""

import bz2
import sys
from pathlib import Path


def main() -> None:
    import gensim
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    src = (Path(gensim.__file__).parent / "test" / "test_data"
           / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
    articles = []
    for _title, text, _pageid in extract_pages(bz2.BZ2File(src)):
        if text.lower().lstrip().startswith("#redirect"):
            continue
        body = filter_wiki(text).strip()
        if len(body) >= 500:
            articles.append(body)
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "enwiki_sample.txt")
    out.write_text("\n\n".join(articles))
    print(f"{len(articles)} articles, {out.stat().st_size:,} bytes -> {out}")


if __name__ == "__main__":
    main()
