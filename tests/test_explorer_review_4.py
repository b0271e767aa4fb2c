"""Fourth review of the Explorer: each test is a problem a read-only probe found, driven through the widgets' own
callbacks.

1. A token's hover title kept a measure's value of the old history: Back, the same token decoded again under
   an intervention, another measure shown meanwhile (the titles were trimmed for the shown measure only).
2. A click on a view point the history no longer holds (a truncate in another cell) did nothing: the views,
   slider and status kept showing the old history.
3. A failed Compute (lens / attribution) was kept, so Compute could not run it again once its cause was gone.
"""

from __future__ import annotations

import html
import re

import pytest
from test_widgets import click

import kimi_explore as ke
from kimi_explore.inspection import interventions as iv
from kimi_explore.views import summaries
from kimi_explore.views.explorer.widgets import Explorer


@pytest.fixture
def session(trained_weights):
    return ke.Session(trained_weights, tokenizer=ke.load_tokenizer(trained_weights))


def plain(markup: str) -> str:
    return html.unescape(re.sub("<[^>]+>", "", markup))


def test_every_measures_titles_follow_a_token_decoded_again(session):
    ex = Explorer(session, prompt="Hello there", measure="KDA state change")
    for _ in range(5):
        ex.step_button.click()
    ex.measure.value = "surprisal"
    ex.back_button.click()
    session.hooks.extend(iv.zero_kda_head([1, 2], [0, 1]))  # another cell
    ex.step_button.click()  # token 4 again, the same id, other values
    ex.measure.value = "KDA state change"
    now = summaries.token_measures(session.trace())["KDA state change"][4]
    assert ex.history.measures["KDA state change"][4] == now
    assert ex.text.titles[4] == f"token 4 'o': KDA state change {now:.4g}; click to select"


def test_a_click_after_a_truncate_elsewhere_shows_the_history_as_it_is(session):
    ex = Explorer(session, prompt="Hello there, world")
    ex.play_button.click()
    assert ex.views["block_layer"].meta["tokens"] == 18
    session.truncate(3)  # another cell
    click(ex.views["block_layer"], x="12 'w'", y="current")  # token 12 of the map drawn before
    assert ex.views["block_layer"].meta["tokens"] == 3 and ex.token.max == 2
    assert plain(ex.status.value).startswith("3 tokens decoded")
    session.truncate(2)
    click(ex.views["block_token"], x="output", y="current")  # the final-mix column: no id
    assert ex.views["block_layer"].meta["tokens"] == 2


def test_compute_runs_again_what_failed(session):
    ex = Explorer(session, prompt="Hello lens")
    for _ in range(6):
        ex.step_button.click()
    ex.select(token=4)
    ex.tabs.selected_index = 4
    session.hooks.extend(iv.zero_kda_head([1, 2], [0, 1, 2, 3]))  # the history does not replay under it
    ex.tab_views.compute_button.click()
    assert plain(ex.views["lens"].spec["layout"]["annotations"][0]["text"]).startswith("No lens for token 4: replaying")
    session.hooks.clear()
    ex.tab_views.compute_button.click()
    assert not ex.views["lens"].spec["layout"].get("annotations")  # drawn
