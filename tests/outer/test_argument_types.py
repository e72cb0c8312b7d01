"""Every transform of the DiLoCo family checks its Optax arguments where
they are given: a ``TypeError`` naming ``inner``, ``outer`` or ``codec``."""

import inspect

import optax
import pytest

import loc_opt
from loc_opt import outer as outer_lib


def _constructors(arg):
  return sorted(
      name for name in dir(outer_lib)
      if not name.startswith('_') and inspect.isfunction(
          getattr(outer_lib, name))
      and arg in inspect.signature(getattr(outer_lib, name)).parameters)


def _call(name, **given):
  fn = getattr(outer_lib, name)
  kwargs = {}
  for p in inspect.signature(fn).parameters.values():
    if p.name in given:
      kwargs[p.name] = given[p.name]
    elif p.default is inspect.Parameter.empty:
      kwargs[p.name] = 4  # the type checks come first
  args = [kwargs.pop(p) for p in list(kwargs)
          if inspect.signature(fn).parameters[p].kind
          is inspect.Parameter.POSITIONAL_OR_KEYWORD]
  return fn(*args, **kwargs)


TRANSFORMS = _constructors('inner')


def test_the_family_is_covered():
  assert {'diloco', 'local_sgd', 'streaming_diloco', 'noloco', 'co2',
          'hierarchical_diloco', 'decoupled_diloco'} <= set(TRANSFORMS)


@pytest.mark.parametrize('name', TRANSFORMS)
@pytest.mark.parametrize('inner, hint', [
    (None, ''), (optax.sgd, 'call it'), (0.1, 'a learning rate goes inside')])
def test_inner_that_is_not_a_transformation(name, inner, hint):
  with pytest.raises(TypeError, match=r'^inner must be an Optax '
                     r'GradientTransformation.*' + hint):
    _call(name, inner=inner)


@pytest.mark.parametrize('name', [n for n in TRANSFORMS
                                  if n in _constructors('outer')])
def test_outer_that_is_not_a_transformation(name):
  with pytest.raises(TypeError, match=r'^outer must be an Optax .*got 0\.7; '
                     r'a learning rate goes inside one'):
    _call(name, inner=optax.sgd(0.1), outer=0.7)


def test_codec_that_is_not_a_codec_names_the_argument():
  with pytest.raises(TypeError, match=r'^codec must be a loc_opt.compression '
                     r'codec'):
    loc_opt.diloco(optax.sgd(0.1), sync_every=4, codec=3)
  with pytest.raises(ValueError, match=r"unknown codec 'int3' for codec;"):
    loc_opt.diloco(optax.sgd(0.1), sync_every=4, codec='int3')
