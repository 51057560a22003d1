"""The `muon_*` settings have one home (integrations.muon_settings.MuonSettings): megatron.training's
flags and the factory's arguments take their defaults from it, each front end reads the settings
with MuonSettings.of, and a config's value that no flag's parser checked is refused naming its
field. (Bridge's MuonOptimizerConfig: tests_bridge.)"""

import argparse
import inspect

from megatron_muon.arguments import add_muon_args
from megatron_muon.integrations.factory import get_megatron_optimizer
from megatron_muon.integrations.muon_settings import MuonSettings


def test_the_flags_and_the_factory_default_to_the_settings_defaults():
    flags = add_muon_args(argparse.ArgumentParser()).parse_args([])
    assert MuonSettings.of(flags) == MuonSettings()
    parameters = inspect.signature(get_megatron_optimizer).parameters
    assert {name: parameters[name].default for name in parameters if name.startswith("muon_")} \
        == MuonSettings().factory_arguments()


def test_a_source_reads_its_own_values_and_the_defaults_of_what_it_lacks():
    flags = add_muon_args(argparse.ArgumentParser()).parse_args(
        ["--muon-dist-mode", "allgather", "--muon-max-team-size", "4"])
    assert MuonSettings.of(flags) == MuonSettings(dist_mode="allgather", max_team_size=4)
    assert MuonSettings.of(argparse.Namespace(muon_check_interval=5)) == MuonSettings(
        check_interval=5)


def test_a_value_no_parser_checked_is_refused_naming_its_field():
    def field(name):
        return f"cfg.optimizer.muon_{name}"

    assert MuonSettings().refusal(field) is None
    assert MuonSettings(owner_choice="fastest").refusal(field) == (
        "cfg.optimizer.muon_owner_choice 'fastest': choose from ('time', 'bytes')")
    assert MuonSettings(max_exchange_bytes=-1).refusal(field).startswith(
        "cfg.optimizer.muon_max_exchange_bytes -1: None (what Muon's state saves a rank) or a "
        "positive number of bytes")
    assert MuonSettings(max_exchange_bytes=1 << 30).refusal(field) is None
