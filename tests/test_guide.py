"""The instructor guide's agendas add up: each total is the sum of its parts, and each lesson's time in an agenda is
the time the lesson table gives it."""
import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "instructor_guide.md"


def _table(text: str) -> dict[str, int]:
    """Lesson number -> minutes, from the table's "Teach in" column."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\| (\d\d) \|.*\| (\d+) min \|$", text, re.M)}


def _agendas(text: str) -> list[tuple[str, int, list[tuple[str, int]]]]:
    """(name, stated total in minutes, [(item, minutes)]) for each "**Name (X h Y min...):**" paragraph."""
    out = []
    for m in re.finditer(r"\*\*([^*(]+)\((\d+) h (\d+) min[^)]*\):\*\*(.*?)(?=\n\n)", text, re.S):
        items = re.findall(r"\b(\d\d|break|lunch|lab|demo) \((\d+)\)", m.group(4))
        out.append((m.group(1).strip(), int(m.group(2)) * 60 + int(m.group(3)), [(i, int(n)) for i, n in items]))
    return out


def test_every_lesson_has_a_teaching_time():
    lessons = sorted(p.name[:2] for p in (GUIDE.parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(_table(GUIDE.read_text())) == lessons and len(lessons) >= 19


def test_agendas_add_up_and_use_the_tables_times():
    text = GUIDE.read_text()
    table, agendas = _table(text), _agendas(text)
    assert [name for name, _, _ in agendas] == ["Half day", "Full day", "Engine day"]
    for name, total, items in agendas:
        assert sum(n for _, n in items) == total, name
        for item, minutes in items:
            if item.isdigit():
                assert table[item] == minutes, f"{name}: lesson {item} is {minutes} min here, {table[item]} in the table"


def test_a_wrong_sum_would_be_caught():
    bad = "| 00 | x | y | 1 s | 30 min |\n\n**Half day (1 h 0 min):** 00 (30) → break (15).\n\n"
    (name, total, items), = _agendas(bad)
    assert sum(n for _, n in items) != total
