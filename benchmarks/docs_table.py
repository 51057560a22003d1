"""A generated table in a docs page, between its two marker comments (the flag sweep's in
docs/flags.md, the carry-over table's in docs/reliability.md), made from a results file that a
run of every row writes."""

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path


def with_table(page: str, start: str, end: str, table: str) -> str:
    """`page` with `table` between its `start` and `end` markers, in place of what was there."""
    before, _, rest = page.partition(start)
    _, _, after = rest.partition(end)
    return f"{before}{start}\n{table}\n{end}{after}"


@dataclasses.dataclass(frozen=True)
class GeneratedTable:
    """A table of `rows` (each with a `name`): their results in `results` (JSON, in the rows'
    order, each with its "row" and "as_expected"), and `markdown(results)` between `start` and
    `end` in `page`."""

    rows: Sequence
    results: Path
    page: Path
    start: str
    end: str
    markdown: Callable[[list[dict]], str]

    def collecting(self) -> Iterator[dict[str, dict]]:
        """A test module's fixture: {row name: its result} as its tests run them, written
        (`write`) once every row of the table has run (`make carry-over`, `make sweep`)."""
        collected: dict[str, dict] = {}
        yield collected
        if len(collected) == len(self.rows):
            self.write(collected)

    def write(self, collected: dict[str, dict]) -> None:
        """The results of every row (`collected`: {row name: its result}) in the rows' order,
        and the page's table from them."""
        ordered = [collected[row.name] for row in self.rows]
        self.results.write_text(json.dumps(ordered, indent=1) + "\n")
        self.page.write_text(self._with_table(self.page.read_text(), ordered))

    def mismatches(self) -> list[str]:
        """What keeps the committed page from showing the committed results of a run of every
        row as the table is now, each ending as its row says; empty where nothing does."""
        results = json.loads(self.results.read_text())
        wrong = []
        if [result["row"] for result in results] != [row.name for row in self.rows]:
            wrong.append(f"{self.results.name} has other rows than the table")
        wrong += [f"{result['row']}: not as expected" for result in results
                  if not result["as_expected"]]
        page = self.page.read_text()
        if self._with_table(page, results) != page:
            wrong.append(f"{self.page.name}'s table is not the one {self.results.name} makes")
        return wrong

    def _with_table(self, page: str, results: list[dict]) -> str:
        return with_table(page, self.start, self.end, self.markdown(results))
