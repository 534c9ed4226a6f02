"""Running code per replica or across replicas, from either context.

The window-end logic is written once and runs in replica context (the
default strategy, and strategies that update without `merge_call`) or in
cross-replica context (inside `merge_call`, as MirroredStrategy needs for an
optimizer update taken under a condition). These helpers hide which.
"""

import tensorflow as tf

from accum_model.core import divisor


def for_each_replica(fn, *args):
    """Runs `fn(*args)` once on every replica and returns its result(s)."""
    if tf.distribute.in_cross_replica_context():
        strategy = tf.distribute.get_strategy()
        return strategy.extended.call_for_each_replica(fn, args=args)
    return fn(*args)


def sum_on_each_replica(fn):
    """Sums what `fn()` computes on each replica; one all-reduce.

    `fn` returns one tensor (a list may travel as one collective per
    tensor). The same replica-context all-reduce the optimizer uses for
    gradients, from either context. Returns each
    replica's copy of the sum: a tensor (list) in replica context, per
    replica values in cross-replica context, for `for_each_replica` to
    hand each replica its own.
    """

    def replica_sum():
        return tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, fn()
        )

    if tf.distribute.in_cross_replica_context():
        strategy = tf.distribute.get_strategy()
        return strategy.extended.call_for_each_replica(replica_sum)
    return replica_sum()


def first_local(value):
    """The first local replica's copy of `value`, usable in this context."""
    if tf.distribute.in_cross_replica_context():
        strategy = tf.distribute.get_strategy()
        return strategy.experimental_local_results(value)[0]
    return value


def sum_over_replicas(fn):
    """The sum over replicas of the tensor `fn()`, as one tensor usable in
    the current context (see `sum_on_each_replica`)."""
    return first_local(sum_on_each_replica(fn))


def is_first_replica():
    """Replica context: a bool tensor, True on the first replica."""
    context = tf.distribute.get_replica_context()
    return tf.equal(context.replica_id_in_sync_group, 0)


def has_data_on_some_replica(samples, strategy, exact):
    """Whether a step's micro-batch has samples on some replica.

    On one replica that is local knowledge. Across replicas it takes a
    reduction, paid only when `exact` is asked for: where an empty step
    cannot shift a window (it comes last in its epoch, and the window is
    applied right after it), every step counts, and a window of empty steps
    alone is discarded when it ends.
    """
    if strategy.num_replicas_in_sync == 1:
        return samples > 0
    if not exact:
        return tf.constant(True)
    return sum_over_replicas(lambda: samples) > 0


def in_cross_replica_context(fn):
    """Runs `fn()` once, in cross-replica context, from either context."""
    if tf.distribute.in_cross_replica_context():
        return fn()
    return tf.distribute.get_replica_context().merge_call(lambda _: fn())


def run_if(predicate, fn):
    """From replica context, runs `fn()` when `predicate` holds.

    `predicate` must be equal on all replicas. Where the strategy needs
    `merge_call` for optimizer updates, the condition is taken in
    cross-replica context, because a `merge_call` inside a replica-context
    `tf.cond` raises a RuntimeError under MirroredStrategy. `fn` must work in
    both contexts (see `for_each_replica`, `sum_over_replicas`).
    """
    if _strategy_supports_no_merge_call():
        tf.cond(predicate, without_result(fn), do_nothing)
        return

    def cross_replica(strategy, per_replica_predicate):
        # Every replica computed the same predicate: take the first.
        value = strategy.experimental_local_results(per_replica_predicate)[0]
        tf.cond(value, without_result(fn), do_nothing)

    tf.distribute.get_replica_context().merge_call(
        cross_replica, args=(predicate,)
    )


def _strategy_supports_no_merge_call():
    """Whether the current strategy may run its updates without `merge_call`.

    The TensorFlow-private function Keras's own optimizers (2 and 3)
    consult for the same decision.
    """
    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def without_result(fn):
    """`fn` as a `tf.cond` branch that returns nothing."""

    def branch():
        fn()

    return branch


def do_nothing():
    """A `tf.cond` branch that does nothing."""


def local_scalar(name, dtype, aggregation="first", initial=0):
    """A scalar variable of which each replica keeps its own copy.

    Synchronised on read: replicas add to their own copy without any
    communication. Read in cross-replica context, an `aggregation="sum"`
    variable gives the sum over replicas, a `"first"` one the first
    replica's (for values equal on all replicas). Create it under the
    strategy's scope.
    """
    return tf.Variable(
        tf.constant(initial, dtype),
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=(
            tf.VariableAggregation.SUM
            if aggregation == "sum"
            else tf.VariableAggregation.ONLY_FIRST_REPLICA
        ),
        name=name,
    )


def assign_on_every_replica(variable, value):
    """Gives every local replica's copy of `variable` the value `value`
    (eagerly, in cross-replica context)."""
    for component in getattr(variable, "values", (variable,)):
        component.assign(tf.cast(value, component.dtype))


def reduced_as_one_device(loss, reduction, sums_logged_per_replica=False):
    """One replica's reduced `loss` of its share of the batch, replaced by
    the whole batch's, as one device reduces it (replica context).

    `reduction` is the `divisor.Reduction` Keras applied: a mean over valid
    elements or weights becomes the sum over replicas of each replica's
    numerator over the sum of their divisors, a "sum" the sum over
    replicas (over the replicas again where Keras multiplies a summed
    loss's logged value by them: `sums_logged_per_replica`). A scalar of
    the user's own becomes the replicas' scalars weighed by their samples
    (keras 3.6 logs the first replica's loss alone; later Keras weighs the
    replicas' losses by their samples).
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return loss
    # In float32: a float16 loss (Keras 2 under mixed precision) times
    # its element count leaves float16's range.
    wide = tf.cast(loss, tf.float32)
    if reduction.reduction == divisor.SUM:
        whole = context.all_reduce(tf.distribute.ReduceOp.SUM, wide)
        if sums_logged_per_replica:
            whole /= context.num_replicas_in_sync
    elif reduction.divisor is None and reduction.samples is None:
        return loss
    else:
        # A number of the user's own for this replica's share is weighed
        # by its samples, as Keras's loss tracker weighs each step's loss.
        weight = tf.cast(reduction.divisor if reduction.divisor is not None
                         else reduction.samples, tf.float32)
        numerator, weights = context.all_reduce(
            tf.distribute.ReduceOp.SUM, [wide * weight, weight])
        whole = tf.math.divide_no_nan(numerator, weights)
    return tf.cast(whole, loss.dtype)
