"""Every entry of every facts file holds on both sides: the real artifact has it, the role still says it."""

from __future__ import annotations

import contractlib
import pytest
from contractlib import note_reading

FACTS = contractlib.load_facts()
PROBED = [f for f in FACTS if f.probe]


def test_facts_files_follow_the_schema() -> None:
    assert FACTS, f"no facts entries under {contractlib.FACTS_DIR}"
    for fact in FACTS:
        assert contractlib.validate_entry(fact.entry, fact.id) == []


@pytest.mark.parametrize("fact", PROBED, ids=lambda f: f.id)
def test_real_artifact_has_the_fact(fact: contractlib.Fact) -> None:
    reading, how = contractlib.reading_for(fact)
    note_reading(how)
    assert contractlib.matches(fact, reading), (
        f"{fact.id}: {reading.package} {reading.version} ({how}, {reading.where}) has {reading.value!r}, "
        f"not {fact.value!r} (probe {fact.probe})"
    )
    package_file = reading.pool.rsplit("/", 1)[-1].split("_")[0]
    assert str(fact.source).startswith(f"{reading.archive}:") and f"/{package_file}_" in str(fact.source), (
        f"{fact.id}: source {fact.source!r} does not name the package read ({reading.where}): "
        "run `python tests/contracts/refresh.py`"
    )


@pytest.mark.parametrize("fact", FACTS, ids=lambda f: f.id)
def test_role_says_the_fact(fact: contractlib.Fact) -> None:
    ok, said = contractlib.role_says(fact)
    verb = "must not use" if fact.entry.get("role_must_not_use") else "must use"
    assert ok, f"{fact.id}: role {fact.role} {verb} {fact.value!r} in {fact.variable}; it has {said}"


def test_ubuntu_fixtures_record_every_ubuntu_probe() -> None:
    """CI without the Ubuntu archive needs a recording of each Ubuntu probe, with where it came from."""
    missing = []
    for fact in PROBED:
        if fact.probe["archive"] != "ubuntu":
            continue
        try:
            reading = contractlib.read_fixture(fact)
        except contractlib.ContractError as err:
            missing.append(str(err))
            continue
        assert reading.sha256 and reading.pool.startswith("pool/") and reading.version, fact.id
        assert contractlib.matches(fact, reading), f"{fact.id}: the fixture records {reading.value!r}"
    assert not missing, "\n".join(missing)
