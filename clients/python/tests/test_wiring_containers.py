"""Modules held in plain containers, nested or not, are found at registration
(``modules_not_registered``); modules a child keeps a list of are registered
elsewhere and are not."""

from __future__ import annotations

from torch import nn

from gradflow.measurement import wiring


class PairsInAList(nn.Module):
    """pytorch/pytorch#715's classifier: hidden layers built in a loop as
    [layer, activation] pairs kept in a plain list."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.hids = [[nn.Linear(16, 16), nn.Tanh()] for _ in range(2)]
        self.classifier = nn.Linear(16, 3)


class Registered(nn.Module):
    """The same layers in an nn.ModuleList, and a plain list of views of them."""

    def __init__(self) -> None:
        super().__init__()
        self.hids = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.views = [[self.hids[0]], {"last": self.hids[1]}]


def not_registered(model: nn.Module):
    return [f for f in wiring.findings(model) if f["kind"] == "modules_not_registered"]


def test_layers_nested_in_plain_lists_are_found():
    [finding] = not_registered(PairsInAList())
    assert (finding["module"], finding["attribute"]) == ("", "hids")
    assert finding["params"] == 4  # two weights, two biases


def test_plain_containers_of_registered_modules_are_not_found():
    assert not_registered(Registered()) == []
